"""Where the probes' time goes, and how much of it the engine's step hides.

    python -m vllm_tour.bench.overhead_profile [--requests 64]
    python -m vllm_tour.bench.overhead_profile --gpu --backend FLASH_ATTN [--slack 0,150,300,450]

The overhead bench's engine and workload (vllm_tour/bench/overhead.py), three parts:
  slack    — untraced rounds with a busy wait of X us of host CPU added to every
             Scheduler.schedule call, X from --slack, interleaved up then down: the
             step's wall time against X says how much host time per step the engine
             hides (with async scheduling on a GPU, the host runs ahead of the device
             by that much) and what each further us costs;
  sections — one traced round, each hook and the probe functions below it timed
             (thread CPU time; a function's time includes the ones it calls);
  cprofile — one traced round with cProfile on inside the hooks only: time by
             function, builtins (numpy, encode, write) included. cProfile's own
             cost inflates Python-level functions; read it for proportions.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from vllm_tour.bench import overhead

# Probe functions timed in the sections part: (module, function); each wrapped where it is looked up (the
# module's global), so calls between them are timed too.
SECTIONS = {
    "attention": ("_host_tables", "_host_view", "_block_rows", "_trim_rows", "_layers"),
    "runner": ("int_list", "_device_after", "_values", "_array"),
    "kv": ("kv_record", "prefix_hits"),
    "scheduler": ("_scheduled",),
}


def _timed_sections(acc: dict[str, float]) -> list:
    """Wrap the SECTIONS functions (and the writer's encode and flush); returns what to put back."""
    import importlib

    from vllm_tour.trace import writer

    undo = []

    def wrap(owner, name, label):
        fn = getattr(owner, name)
        setattr(owner, name, overhead.thread_timed(fn, acc, label))
        undo.append((owner, name, fn))

    for mod, names in SECTIONS.items():
        module = importlib.import_module(f"vllm_tour.probes.{mod}")
        for name in names:
            wrap(module, name, f"{mod}.{name}")
    wrap(writer, "_encode", "writer._encode")
    wrap(writer.Recorder, "flush", "writer.Recorder.flush")
    return undo


def _busy_schedule(extra_us: list[float]):
    """Scheduler.schedule with a busy wait of extra_us[0] us of thread CPU after it; returns the undo."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule

    def schedule(self, *a, **k):
        out = original(self, *a, **k)
        t0 = time.thread_time()
        while (time.thread_time() - t0) * 1e6 < extra_us[0]:
            pass
        return out

    Scheduler.schedule = schedule
    return lambda: setattr(Scheduler, "schedule", original)


def measure_slack(round_, values: list[float]) -> dict[float, list[float]]:
    """ms per step of untraced rounds with each busy wait of `values` (us per schedule() call), up then down."""
    extra = [0.0]
    undo = _busy_schedule(extra)
    by_extra: dict[float, list[float]] = {x: [] for x in values}
    try:
        for k, x in enumerate(values + values[::-1]):
            extra[0] = x
            by_extra[x].append(statistics.mean(round_(f"slack{k}")) * 1e3)
    finally:
        undo()
    return by_extra


def measure_sections(round_, resolved, run_dir) -> tuple[int, dict[str, float], dict[str, float]]:
    """One traced round with the hooks and the SECTIONS timed: (steps, us per step by hook, by section)."""
    hook_s: dict[str, float] = {}
    acc: dict[str, float] = {}
    undo = _timed_sections(acc)
    try:
        steps = len(round_("sections", overhead.timed_probes(resolved, hook_s), run_dir))
    finally:
        for owner, name, fn in reversed(undo):
            setattr(owner, name, fn)

    def per_step(times: dict[str, float]) -> dict[str, float]:
        return {k: round(v / steps * 1e6, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1]) if v}

    return steps, per_step(hook_s), per_step(acc)


def profile_hooks(round_, resolved, run_dir) -> tuple[int, list[tuple[str, float, float, float]]]:
    """One traced round with cProfile on inside the hooks only: (steps, the top 40 functions by own time as
    (name, calls, own us, us with callees) per step)."""
    prof = cProfile.Profile()

    def profiled(label, fn):
        def hook(*a, **k):
            prof.enable()
            try:
                return fn(*a, **k)
            finally:
                prof.disable()

        return hook

    steps = len(round_("cprofile", overhead.wrapped_hooks(resolved, profiled), run_dir))
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:40]
    return steps, [(f"{Path(f).name}:{line}({fn})" if line else fn, calls / steps, tt / steps * 1e6, ct / steps * 1e6)
                   for (f, line, fn), (_, calls, tt, ct, _) in top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    overhead.add_engine_args(ap)
    ap.add_argument("--slack", default="0,150,300,450", help="us of host CPU added per schedule() call, one untraced round each way")
    args = ap.parse_args()

    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_tour.probes.install import check_probes
    from vllm_tour.probes.run_env import PIN_ENV
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    os.environ[PIN_ENV] = tag
    resolved = [r for r in check_probes(tag, backend=args.backend if args.gpu else None, tp_size=1) if not r.probe.capture_only]
    engine_args, shapes, reqs, temperature = (overhead.gpu_engine_args if args.gpu else overhead.cpu_engine_args)(EngineArgs, args)
    engine = LLMEngine.from_engine_args(engine_args)
    result: dict = {"engine": shapes, "hardware": overhead.hardware(), "pin": tag}
    print(f"engine: {shapes}", flush=True)

    def round_(tag_, probes=None, run_dir=None):
        wall, _ = overhead.run_round(engine, reqs, SamplingParams, tag_, temperature, probes, run_dir)
        return wall

    round_("warmup")
    slack_values = [float(x) for x in args.slack.split(",") if x.strip()]
    by_extra = measure_slack(round_, slack_values)
    base = statistics.mean(by_extra[slack_values[0]]) if slack_values else None
    result["slack_ms_per_step"] = {str(x): [round(v, 4) for v in vs] for x, vs in by_extra.items()}
    print("slack: added us per schedule() -> ms per step (two rounds), ratio to the first")
    for x, vs in by_extra.items():
        print(f"  {x:6.0f} us -> {statistics.mean(vs):.3f} ms ({', '.join(f'{v:.3f}' for v in vs)})"
              + (f"  ratio {statistics.mean(vs) / base:.3f}" if base else ""), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        round_("warmup-traced", resolved, tmp)
        steps, hooks, sections = measure_sections(round_, resolved, tmp)
        psteps, rows = profile_hooks(round_, resolved, tmp)
    result.update(steps_per_round=steps, hooks_us_per_step=hooks, hooks_total_us_per_step=round(sum(hooks.values()), 1),
                  sections_us_per_step=sections)
    print(f"hooks: {sum(hooks.values()):.0f} us per step over {steps} steps")
    for k, v in hooks.items():
        print(f"  {k:36s} {v:7.1f}")
    print("sections (us per step; a function's time includes its callees):")
    for k, v in sections.items():
        print(f"  {k:36s} {v:7.1f}")
    print(f"cprofile over {psteps} steps (us per step; cProfile's own cost inflates Python-level functions):")
    print(f"  {'function':58s} {'calls':>6s} {'own':>7s} {'with callees':>12s}")
    for name, calls, tt, ct in rows:
        print(f"  {name[:58]:58s} {calls:6.1f} {tt:7.1f} {ct:12.1f}")
    result["cprofile_us_per_step"] = [{"function": n, "calls": round(c, 1), "own_us": round(t, 1), "with_callees_us": round(w, 1)}
                                      for n, c, t, w in rows]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
