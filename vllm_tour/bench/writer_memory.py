"""Trace writer memory over a long run: RSS growth after warm-up, 10,000 steps with the probes recording.

    python -m vllm_tour.bench.writer_memory [--steps 10000] [--warmup 1000] [--json PATH]

Upstream's real Scheduler at the installed pin, driven by vllm_tour/bench/sched_load.py
(tiny-qwen3's engine config), with a steady stream of requests: one arrives every step
(48-token prompt, 32 output tokens, a fresh id each), so about 32 run at once and
every id is new to the probes. Two runs in this
process: untraced, then traced (scheduler and KV probes, the records written to
a temporary run directory). RSS is read after `--warmup` steps and at the end,
after a full garbage collection; the traced run's growth minus the untraced
run's is what the probes keep. Goal: traced growth < 20 MB.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from vllm_tour.bench import sched_load
from vllm_tour.bench.overhead import hardware, write_results
from vllm_tour.bench.sched_load import PROMPT_TOKENS

OUTPUT_TOKENS = 32


def drive(sched, steps: int, warmup: int, seed: int = 0) -> dict:
    """Run `steps` scheduler steps; RSS (bytes) after `warmup` steps and at the end."""
    rss, running = sched_load.drive(sched, steps, arrival_p=1.0, output_tokens=(OUTPUT_TOKENS, OUTPUT_TOKENS),
                                    rss_at={warmup, steps}, id_prefix="m", seed=seed)
    return {"rss_after_warmup": rss[warmup], "rss_end": rss[steps], "growth": rss[steps] - rss[warmup], "running_at_end": running}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=1_000)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if not 0 < args.warmup < args.steps:
        raise SystemExit("--warmup must be between 0 and --steps")

    import vllm

    from vllm_tour.engine.run import engine_kwargs
    from vllm_tour.engine.sched_harness import _make_scheduler, scheduler_probes
    from vllm_tour.probes.base import install, uninstall
    from vllm_tour.probes.install import check_probes
    from vllm_tour.probes.run_env import PIN_ENV
    from vllm_tour.scenario import Scenario
    from vllm_tour.trace.writer import RECORDER
    from vllm_tour.upstream.models import resolve_model
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    os.environ[PIN_ENV] = tag
    scenario = Scenario.model_validate({"name": "writer_memory", "requests": [{"id": "r0", "token_ids": [5] * PROMPT_TOKENS}]})
    kwargs = engine_kwargs(scenario, resolve_model(scenario.model), tag)
    resolved = check_probes(tag, probes=scheduler_probes())
    results = {}
    for side in ("untraced", "traced"):
        sched = _make_scheduler(kwargs, async_sched=False)
        with tempfile.TemporaryDirectory() as tmp:
            if side == "traced":
                install(resolved, RECORDER)
                RECORDER.activate(tmp)
            try:
                results[side] = drive(sched, args.steps, args.warmup)
            finally:
                RECORDER.deactivate()
                uninstall(resolved)
                results[side]["trace_bytes"] = sum(f.stat().st_size for f in Path(tmp).iterdir()) if side == "traced" else 0
        del sched
    mb = 1 << 20
    probes_growth = results["traced"]["growth"] - results["untraced"]["growth"]
    hw = hardware()
    print(f"hardware: {hw['cpu']}{' (AMX)' if hw['amx'] else ''}, {hw['cores']} cores")
    print(f"engine:   vLLM {vllm.__version__} (pin {tag}), upstream Scheduler only (sched_harness), tiny-qwen3 config, "
          f"block {kwargs['block_size']}, prefix caching {kwargs['enable_prefix_caching']}")
    print(f"workload: {args.steps} steps, one request arriving per step ({PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} output tokens, fresh id with upstream's suffix), "
          f"RSS after {args.warmup} steps and at the end")
    for side, r in results.items():
        print(f"{side + ':':10}{r['rss_after_warmup'] / mb:8.1f} MB -> {r['rss_end'] / mb:8.1f} MB, growth {r['growth'] / mb:+.1f} MB"
              + (f" ({r['trace_bytes'] // mb} MB of records written)" if side == "traced" else ""))
    print(f"probes:   growth traced - untraced {probes_growth / mb:+.1f} MB; traced growth {results['traced']['growth'] / mb:+.1f} MB   goal < 20 MB")
    if args.json:
        write_results(args.json, "vllm_tour.bench.writer_memory", {
            "hardware": hw, "vllm_version": vllm.__version__, "pin": tag,
            "workload": {"steps": args.steps, "warmup_steps": args.warmup, "prompt_tokens": PROMPT_TOKENS,
                         "output_tokens": OUTPUT_TOKENS, "requests_arriving_per_step": 1},
            "results_bytes": results, "probes_growth_bytes": probes_growth, "goal_bytes": 20 * mb,
        })


if __name__ == "__main__":
    main()
