"""Probe overhead: the same 64-request workload untraced vs traced, A/B interleaved in one process.

    python -m vllm_tour.bench.overhead [--rounds 10] [--requests 64] [--max-tokens 32]

One in-process engine (tiny-qwen3, prefix caching off so every round does the
same work). Rounds alternate A B B A ...: A runs with the probes uninstalled
(pristine upstream callables), B with them installed and recording at the
metadata level (scheduler, KV, runner and attention records; no tensors).

Three figures, because the machines this runs on are shared:
  wall  — mean step wall time, traced / untraced (what a user feels; noisy
          when other processes compete for the 2 cores);
  cpu   — mean step CPU time of this process, traced / untraced (barely moved
          by other processes);
  hooks — CPU time spent inside the probe hooks per step, as a share of the
          untraced step's CPU time (the probes' own cost, measured directly).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def workload(n: int, max_tokens: int, seed: int = 0):
    """n requests with random token-id prompts of 16-128 tokens (same every call)."""
    rng = random.Random(seed)
    return [([rng.randrange(5, 500) for _ in range(rng.randrange(16, 129))], max_tokens) for _ in range(n)]


def run_round(engine, reqs, SamplingParams, tag: str) -> tuple[list[float], list[float]]:
    """Run the workload to completion; (wall seconds, process CPU seconds) per step."""
    for i, (ids, mt) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True))
    wall, cpu = [], []
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def timed_probes(resolved, hook_s: dict[str, float]):
    """The same probes with each hook's thread CPU time added to hook_s[name]."""

    def timed(name, fn):
        if fn is None:
            return None
        hook_s[name] = 0.0

        def hook(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                hook_s[name] += time.thread_time() - t0

        return hook

    out = []
    for r in resolved:
        p = r.probe
        probe = dataclasses.replace(p, before=timed(p.name + ".before", p.before), after=timed(p.name + ".after", p.after))
        out.append(dataclasses.replace(r, probe=probe))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="rounds per side (default 10)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from ..models import resolve_model
    from ..pins import active_pin_tag
    from ..probes.base import install, uninstall
    from ..probes.install import check_probes
    from ..trace.writer import RECORDER

    tag = active_pin_tag()
    resolved = [r for r in check_probes(tag) if not r.probe.capture_only]
    hook_s: dict[str, float] = {}
    timed = timed_probes(resolved, hook_s)  # for the breakdown round only: timing costs too
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(resolve_model("tiny-qwen3")), dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20,
                   max_model_len=1024, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=True, use_tqdm_on_load=False, seed=0)
    )
    reqs = workload(args.requests, args.max_tokens)
    run_round(engine, reqs, SamplingParams, "warmup")
    order = (["A", "B", "B", "A"] * args.rounds)[: 2 * args.rounds]
    wall: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    traced_steps = steps = 0
    with tempfile.TemporaryDirectory() as tmp:
        for k, side in enumerate(order):
            if side == "B":
                install(resolved, RECORDER)
                RECORDER.activate(tmp, "", "")
            w, c = run_round(engine, reqs, SamplingParams, f"{side}{k}")
            if side == "B":
                RECORDER.deactivate()
                uninstall(resolved)
            wall[side].append(statistics.mean(w))
            cpu[side].append(statistics.mean(c))
            steps = len(w)
        trace_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        for k in range(2):  # the breakdown: probes with timed hooks
            install(timed, RECORDER)
            RECORDER.activate(tmp, "", "")
            w, _ = run_round(engine, reqs, SamplingParams, f"T{k}")
            RECORDER.deactivate()
            uninstall(timed)
            traced_steps += len(w)

    med = {s: statistics.median(v) for s, v in wall.items()}
    cmed = {s: statistics.median(v) for s, v in cpu.items()}
    hooks = sum(hook_s.values()) / traced_steps
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, load average {os.getloadavg()[0]:.1f}")
    print(f"engine:   vLLM pin {tag}, tiny-qwen3 (fp32, 2 layers, hidden 256, 4 q / 2 kv heads), in-process, enforce_eager, prefix caching off")
    print(f"workload: {args.requests} requests, prompts 16-128 tokens, {args.max_tokens} tokens each (ignore_eos), {steps} steps per round")
    print(f"rounds:   {args.rounds} per side, interleaved A B B A; {trace_bytes // 1024} KiB of records written by the traced rounds")
    print(f"wall:     untraced {med['A'] * 1e3:.2f} ms/step, traced {med['B'] * 1e3:.2f} ms/step (medians over rounds) -> ratio {med['B'] / med['A']:.3f}")
    print(f"cpu:      untraced {cmed['A'] * 1e3:.2f} ms/step, traced {cmed['B'] * 1e3:.2f} ms/step (medians over rounds) -> ratio {cmed['B'] / cmed['A']:.3f}")
    mn = {s: min(v) for s, v in wall.items()}
    cmn = {s: min(v) for s, v in cpu.items()}
    print(f"minimum:  wall untraced {mn['A'] * 1e3:.2f} / traced {mn['B'] * 1e3:.2f} ms/step -> ratio {mn['B'] / mn['A']:.3f}; "
          f"cpu {cmn['A'] * 1e3:.2f} / {cmn['B'] * 1e3:.2f} -> ratio {cmn['B'] / cmn['A']:.3f} (fastest round per side)")
    print(f"hooks:    {hooks * 1e6:.0f} us CPU per step inside probe hooks (2 extra timed rounds) = {hooks / cmed['A']:.1%} of the untraced step's CPU time")
    top = sorted(hook_s.items(), key=lambda kv: -kv[1])[:4]
    print("          costliest: " + ", ".join(f"{k} {v / traced_steps * 1e6:.0f} us" for k, v in top))
    print(f"overhead (step-time ratio, wall): {med['B'] / med['A']:.3f}   goal <= 1.03")


if __name__ == "__main__":
    main()
