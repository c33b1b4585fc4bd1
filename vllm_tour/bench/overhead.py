"""Probe overhead: the same 64-request workload untraced vs traced, A/B interleaved in one process.

    python -m vllm_tour.bench.overhead [--rounds 10] [--requests 64] [--max-tokens 32]

One in-process engine (tiny-qwen3, prefix caching off so every round does the
same work). Rounds alternate A B B A ...: A runs with the probes uninstalled
(pristine upstream callables), B with them installed and recording (metadata
level: scheduler, KV, runner, attention records; no tensor captures). The
figure is the ratio of mean step times, traced / untraced.
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
    rng = random.Random(seed)
    return [([rng.randrange(5, 500) for _ in range(rng.randrange(16, 129))], max_tokens) for _ in range(n)]


def run_round(engine, reqs, SamplingParams, tag: str) -> list[float]:
    for i, (ids, mt) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


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
    # Each hook is timed too: the probes' own cost per step, a figure that other
    # processes on a busy machine disturb far less than the step-time ratio.
    hook_s: dict[str, float] = {}

    def timed(name, fn):
        if fn is None:
            return None
        hook_s[name] = 0.0

        def hook(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                hook_s[name] += time.perf_counter() - t0

        return hook

    resolved = [
        dataclasses.replace(r, probe=dataclasses.replace(r.probe, before=timed(r.probe.name + ".before", r.probe.before), after=timed(r.probe.name + ".after", r.probe.after)))
        for r in check_probes(tag)
        if not r.probe.capture_only
    ]
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(resolve_model("tiny-qwen3")), dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20,
                   max_model_len=1024, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=True, use_tqdm_on_load=False, seed=0)
    )
    reqs = workload(args.requests, args.max_tokens)
    run_round(engine, reqs, SamplingParams, "warmup")
    order = ["A", "B", "B", "A"] * ((args.rounds + 1) // 2)
    per_side: dict[str, list[float]] = {"A": [], "B": []}
    steps = traced_steps = 0
    hook_rounds: list[float] = []  # probe-hook seconds per step, per traced round
    with tempfile.TemporaryDirectory() as tmp:
        for k, side in enumerate(order[: 2 * args.rounds]):
            if side == "B":
                install(resolved, RECORDER)
                RECORDER.activate(f"{tmp}", "", "")
            hooks_before = sum(hook_s.values())
            times = run_round(engine, reqs, SamplingParams, f"{side}{k}")
            if side == "B":
                hook_rounds.append((sum(hook_s.values()) - hooks_before) / len(times))
            if side == "B":
                RECORDER.deactivate()
                uninstall(resolved)
            per_side[side].append(statistics.mean(times))
            traced_steps += len(times) if side == "B" else 0
            steps = len(times)
        trace_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    a, b = statistics.median(per_side["A"]), statistics.median(per_side["B"])
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}")
    print(f"engine:   vLLM pin {tag}, tiny-qwen3 (fp32, 2 layers, hidden 256), in-process, enforce_eager, prefix caching off")
    print(f"workload: {args.requests} requests, prompts 16-128 tokens, {args.max_tokens} tokens each (ignore_eos), {steps} steps per round")
    print(f"rounds:   {args.rounds} per side, interleaved A B B A; traced records: {trace_bytes // 1024} KiB over {args.rounds} rounds")
    print(f"untraced: mean step {a * 1e3:.2f} ms (median over rounds; rounds {', '.join(f'{x * 1e3:.2f}' for x in per_side['A'])})")
    print(f"traced:   mean step {b * 1e3:.2f} ms (median over rounds; rounds {', '.join(f'{x * 1e3:.2f}' for x in per_side['B'])})")
    per_step = sum(hook_s.values()) / max(traced_steps, 1)
    print(f"probe hooks: {per_step * 1e6:.0f} us per step = {per_step / a:.1%} of the untraced step")
    print(f"  least-disturbed traced round: {min(hook_rounds) * 1e6:.0f} us per step = {min(hook_rounds) / min(per_side['A']):.1%} of the fastest untraced round's step")
    top = sorted(hook_s.items(), key=lambda kv: -kv[1])[:4]
    print("  costliest: " + ", ".join(f"{k} {v / max(traced_steps, 1) * 1e6:.0f} us" for k, v in top))
    best_a, best_b = min(per_side["A"]), min(per_side["B"])
    print(f"ratio traced/untraced: {b / a:.3f} of medians, {best_b / best_a:.3f} of best rounds  (goal <= 1.03)")


if __name__ == "__main__":
    main()
