"""Qwen3-0.6B with dummy weights on the CPU pin: engine start and decode step time, float32 vs bfloat16.

    python -m vllm_tour.bench.qwen3_dummy_cpu [--max-tokens 24] [--dtypes float32,bfloat16]

The headline command's scenario (traces/scenarios/qwen3_06b_hello.toml: "hello", one request), untraced,
in-process, once per dtype in one process. Per step: wall time and this process's CPU time (the machines
are shared: CPU time barely moves when other processes compete for the cores; vLLM's CPU worker runs
torch on one thread here). Prints one line per dtype and the bf16/fp32 ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def measure(dtype: str, max_tokens: int) -> dict:
    from vllm_tour.engine.run import run_upstream
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.scenario import load_scenario

    sc = load_scenario(SCENARIOS_DIR / "qwen3_06b_hello.toml")
    sc.engine.dtype = dtype
    for r in sc.requests:
        r.max_tokens, r.ignore_eos = max_tokens, True
    marks: list[tuple[float, float]] = []

    def progress(step: int, done: int, total: int) -> None:
        marks.append((time.perf_counter(), time.process_time()))

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        run_upstream(sc, Path(d) / "run", probes=False, progress=progress)
    # marks[0]: the engine is up, before step 1; marks[1]: after the prefill; the rest: decode steps
    wall = [b[0] - a[0] for a, b in zip(marks[1:], marks[2:])]
    cpu = [b[1] - a[1] for a, b in zip(marks[1:], marks[2:])]
    return {"dtype": dtype, "start_s": marks[0][0] - t0, "prefill_s": marks[1][0] - marks[0][0],
            "decode_wall_median_s": statistics.median(wall), "decode_wall_min_s": min(wall),
            "decode_cpu_median_s": statistics.median(cpu), "steps": len(wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, AMX {amx}, load {os.getloadavg()[0]:.1f}")
    rows = [measure(d, a.max_tokens) for d in a.dtypes.split(",")]
    for r in rows:
        print(f"{r['dtype']:>9}: engine start {r['start_s']:.1f} s, prefill {r['prefill_s']:.2f} s, decode step "
              f"wall median {r['decode_wall_median_s']:.3f} s (min {r['decode_wall_min_s']:.3f}), "
              f"CPU median {r['decode_cpu_median_s']:.3f} s, {r['steps']} steps")
    if len(rows) == 2:
        x, y = rows
        print(f"{y['dtype']}/{x['dtype']}: decode wall {y['decode_wall_median_s'] / x['decode_wall_median_s']:.2f}x, "
              f"CPU {y['decode_cpu_median_s'] / x['decode_cpu_median_s']:.2f}x, start {y['start_s'] / x['start_s']:.2f}x")


if __name__ == "__main__":
    main()
