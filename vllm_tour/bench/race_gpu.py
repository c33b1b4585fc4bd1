"""The race: the reimpl mini engine against upstream vLLM on nano-vllm's recipe, on one GPU.

    python3 vllm_tour/bench/race_gpu.py [--num-seqs 256] [--sides reimpl-graphs,reimpl-eager,upstream-eager,upstream-graphs]
                                        [--site /tmp/vllm-cuda] [--json $OUT/race.json]

Every side runs in its own subprocess (a clean GPU for each; a side that
hangs or crashes is reported, the others still run), one after the other, in
one invocation, and the ratios are printed from these runs only:

- reimpl-eager / reimpl-graphs: `reimpl/fast_engine.py` -- the mini engine's
  own scheduler, KV-cache manager and block pool (the decisions) with a
  batched bf16 model runner, `reimpl/triton_attn.py` for attention, the fused
  elementwise Triton kernels of `reimpl/fused_ops.py` (add+RMSNorm, q/k-norm+RoPE+
  KV write, SiLU*mul), and (graphs) CUDA graphs for pure-decode steps. Random
  weights, seed 0. (`--count-kernels`: kernels of one decode forward, fused vs not.)
- upstream-eager / upstream-graphs: `race_upstream.py`, vLLM's `LLM` with
  `load_format="dummy"`, TRITON_ATTN, `enforce_eager` True / False (False =
  upstream's default: torch.compile + CUDA graphs). Needs upstream on
  PYTHONPATH (`--site`, default /tmp/vllm-cuda as assembled from .gpu/cuda).

Shapes (both sides): Qwen3-0.6B (vllm_tour/data/qwen3-0.6b-config.json: 28
layers, hidden 1024, 16 q / 8 kv heads, head 128, vocab 151936), bf16,
block size 16, max_model_len 4096, 256 sequences with prompt and output lengths
uniform in 100..1024 (random.seed(0)), temperature 0.6, ignore_eos:
133,966 output tokens. The reimpl uses upstream's defaults for this GPU class
(max_num_batched_tokens 16384, max_num_seqs 1024, prefix caching on, chunked
prefill on); upstream reports what it used.

Throughput = output tokens / wall time of the generate call (the engine's
start-up, weight init, graph capture and warm-up excluded on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vllm_tour.bench.race_recipe import EXPECTED_OUTPUT_TOKENS, MAX_MODEL_LEN, NUM_SEQS, TEMPERATURE, model_config, recipe  # noqa: E402

SIDES = ("reimpl-graphs", "reimpl-eager", "upstream-eager", "upstream-graphs")
UPSTREAM_EAGER_MEASURED = 4282.0  # tok/s, shared/gpu/README.md (one earlier run, same recipe)
UPSTREAM_GRAPHS_MEASURED = 15559.0


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
    outs = eng.generate(reqs)
    st, fc = eng.stats, eng.cfg
    tot = sum(len(v) for v in outs.values())
    return {"side": "reimpl", "mode": mode, "num_seqs": n, "output_tokens": tot, "seconds": round(st.seconds, 3),
            "tok_per_s": round(tot / st.seconds, 1), "init_s": round(init_s, 1),
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


def side_command(side: str, n: int) -> list[str]:
    kind, mode = side.split("-", 1)
    if kind == "reimpl":
        return [sys.executable, str(Path(__file__).resolve()), "--run-reimpl", mode, "--num-seqs", str(n)]
    return [sys.executable, str(Path(__file__).resolve().parent / "race_upstream.py"), mode, "--num-seqs", str(n)]


def ratios(res: dict[str, dict]) -> dict[str, float]:
    tps = {k: v["tok_per_s"] for k, v in res.items() if v and v.get("tok_per_s")}
    out = {}
    for a, b in (("reimpl-eager", "upstream-eager"), ("reimpl-graphs", "upstream-graphs"),
                 ("reimpl-graphs", "upstream-eager"), ("reimpl-eager", "upstream-graphs")):
        if a in tps and b in tps:
            out[f"{a} / {b}"] = round(tps[a] / tps[b], 3)
    return out


def summary_lines(res: dict[str, dict], n: int) -> list[str]:
    lines = [f"{'side':16} {'tok/s':>9} {'seconds':>8} {'out tokens':>10}  notes"]
    for side in SIDES:
        r = res.get(side)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{side:16} {'-':>9} {'-':>8} {'-':>10}  FAILED: {r['error'][:160]}")
            continue
        note = ", ".join(f"{k}={r[k]}" for k in ("init_s", "graph_capture_s", "steps", "graph_steps", "host_s",
                                                "max_num_seqs", "max_num_batched_tokens") if k in r)
        lines.append(f"{side:16} {r['tok_per_s']:9.1f} {r['seconds']:8.2f} {r['output_tokens']:10d}  {note}")
    for k, v in ratios(res).items():
        lines.append(f"ratio {k}: {v:.3f}x")
    exp = EXPECTED_OUTPUT_TOKENS.get(n)
    bad = [s for s, r in res.items() if r and "output_tokens" in r and exp and r["output_tokens"] != exp]
    if bad:
        lines.append(f"WARNING: output tokens differ from the recipe's {exp}: {bad}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--site", default=os.environ.get("SITE", "/tmp/vllm-cuda"), help="upstream vLLM install dir")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per side")
    ap.add_argument("--json", help="write results here (default $OUT/race.json when $OUT is set)")
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

    sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        ap.error(f"unknown side(s) {unknown}; known: {', '.join(SIDES)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (a.site, str(REPO), env.get("PYTHONPATH")) if p)
    try:
        import torch

        device = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        device = f"unknown ({e})"
    print(f"race on {device}; {a.num_seqs} seqs; sides {sides}", flush=True)
    res: dict[str, dict] = {}
    for side in sides:
        t0 = time.time()
        print(f"--- {side}: {' '.join(side_command(side, a.num_seqs))}", flush=True)
        try:
            p = subprocess.run(side_command(side, a.num_seqs), env=env, cwd=REPO, capture_output=True, text=True,
                               timeout=a.timeout)
            text = p.stdout + p.stderr
            r = parse_race_line(p.stdout)
            if r is None:
                tail = "\n".join(text.strip().splitlines()[-25:])
                r = {"error": f"exit {p.returncode}, no RACE line; tail:\n{tail}"}
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            r = {"error": f"timed out after {a.timeout:.0f} s"}
        r["wall_s"] = round(time.time() - t0, 1)
        res[side] = r
        print("\n".join(l for l in text.splitlines() if l.startswith(("RACE", "init")) or "Error" in l)[-3000:], flush=True)
        print(f"--- {side}: {json.dumps(r)[:600]}", flush=True)
    lines = summary_lines(res, a.num_seqs)
    print("\n".join(lines), flush=True)
    path = a.json or (os.path.join(os.environ["OUT"], "race.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps({"device": device, "num_seqs": a.num_seqs, "results": res,
                                          "ratios": ratios(res), "summary": lines,
                                          "upstream_measured_before": {"eager": UPSTREAM_EAGER_MEASURED,
                                                                       "graphs": UPSTREAM_GRAPHS_MEASURED}}, indent=1))
    return 0 if all("error" not in r for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
