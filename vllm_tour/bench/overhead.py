"""Probe overhead: the same workload untraced vs traced, A/B interleaved in one process.

    python -m vllm_tour.bench.overhead [--rounds 10] [--requests 64] [--max-tokens 32] [--json PATH]
    python -m vllm_tour.bench.overhead --gpu --backend FLASH_ATTN|TRITON_ATTN [--eager] [--rounds 3] [--json PATH]

CPU (default): one in-process engine, tiny-qwen3 in fp32, 64 requests x 32
tokens, prefix caching off so every round does the same work.
--gpu: upstream's CUDA engine (the GPU machine's v0.21.0) on the race's recipe
(vllm_tour/bench/race_recipe.py: Qwen3-0.6B shapes with dummy weights, bf16,
max_model_len 4096, 256 sequences; --num-seqs fewer), CUDA graphs + torch.compile
unless --eager, the attention backend given by --backend.
Rounds alternate A B B A ...: A runs with the probes uninstalled (pristine
upstream callables), B with them installed and recording at the metadata level
(scheduler, KV, runner and attention records; no tensors; no TP probes at TP=1).
Each side first runs one warm-up round that is not timed into the ratios (the
traced one is printed: what a trace's first round costs once).

Four figures, because the machines this runs on are shared:
  wall  — mean step wall time, traced / untraced (what a user feels; noisy
          when other processes compete for the 2 cores);
  pairs — the same per A B B A block of four adjacent rounds (a slow drift of
          the machine's load cancels within a block): median and spread;
  cpu   — mean step CPU time of this process, traced / untraced (less moved by
          other processes, but not immune: its compute threads spin while they wait);
  hooks — CPU time spent inside the probe hooks per step, as a share of the
          untraced step's CPU time (the probes' own cost, measured directly).
--json writes the figures with the machine (CPU model, AMX, GPU), the shapes,
the vLLM version and the date (checked in under traces/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def workload(n: int, max_tokens: int, seed: int = 0):
    """n requests with random token-id prompts of 16-128 tokens (same every call)."""
    rng = random.Random(seed)
    return [([rng.randrange(5, 500) for _ in range(rng.randrange(16, 129))], max_tokens) for _ in range(n)]


def run_round(engine, reqs, SamplingParams, tag: str, temperature: float = 0.0, probes=None,
              run_dir: str | None = None) -> tuple[list[float], list[float]]:
    """Run the workload to completion; (wall seconds, process CPU seconds) per step. With `probes` (resolved
    probes): installed and recording into `run_dir` for this round only."""
    from vllm_tour.probes.base import install, uninstall
    from vllm_tour.trace.writer import RECORDER

    if probes is not None:
        install(probes, RECORDER)
        RECORDER.activate(run_dir, "", "")
    wall, cpu = [], []
    try:
        detokenize = not engine.vllm_config.model_config.skip_tokenizer_init  # the GPU recipe has no tokenizer
        for i, (ids, mt) in enumerate(reqs):
            params = SamplingParams(max_tokens=mt, temperature=temperature, ignore_eos=True, detokenize=detokenize)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    finally:
        if probes is not None:
            RECORDER.deactivate()
            uninstall(probes)
    return wall, cpu


def thread_timed(fn, acc: dict[str, float], label: str):
    """`fn` with the thread CPU time of each call added to acc[label]."""
    acc[label] = 0.0

    def timed(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[label] += time.thread_time() - t0

    return timed


def wrapped_hooks(resolved, wrap):
    """The same probes with each hook replaced by wrap(label, hook), label "<probe>.before" or "<probe>.after"."""

    def hook(p, when):
        fn = getattr(p, when)
        return None if fn is None else wrap(f"{p.name}.{when}", fn)

    return [dataclasses.replace(r, probe=dataclasses.replace(r.probe, before=hook(r.probe, "before"), after=hook(r.probe, "after")))
            for r in resolved]


def timed_probes(resolved, hook_s: dict[str, float]):
    """The same probes with each hook's thread CPU time added to hook_s[name]."""
    return wrapped_hooks(resolved, lambda label, fn: thread_timed(fn, hook_s, label))


def cpu_engine_args(EngineArgs, args):
    from vllm_tour.upstream.models import resolve_model

    shapes = "tiny-qwen3 (fp32, 2 layers, hidden 256, 4 q / 2 kv heads), enforce_eager, prefix caching off"
    return EngineArgs(model=str(resolve_model("tiny-qwen3")), dtype="float32", block_size=32, kv_cache_memory_bytes=64 << 20,
                      max_model_len=1024, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=True,
                      use_tqdm_on_load=False, seed=0), shapes, workload(args.requests, args.max_tokens), 0.0


def gpu_engine_args(EngineArgs, args):
    """The race's upstream side (race_upstream.py), with the backend asked for."""
    from vllm_tour.bench.race_recipe import CONFIG, MAX_MODEL_LEN, TEMPERATURE, recipe, upstream_engine_kwargs

    prompts, max_tokens = recipe(args.num_seqs)
    shapes = (f"Qwen3-0.6B shapes ({CONFIG.name}), dummy weights, bf16, {args.backend}, "
              + ("enforce_eager" if args.eager else "CUDA graphs + torch.compile") + f", max_model_len {MAX_MODEL_LEN}")
    engine_args = EngineArgs(**upstream_engine_kwargs(args.backend, args.eager), disable_log_stats=True, seed=0)
    return engine_args, shapes, list(zip(prompts, max_tokens)), TEMPERATURE


def hardware() -> dict:
    hw = {"cpu": cpu_name(), "amx": "amx_bf16" in cpu_flags(), "cores": os.cpu_count(), "system": f"{platform.system()} {platform.machine()}"}
    try:
        import torch

        if torch.cuda.is_available():
            hw["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch CUDA: a CPU machine
        pass
    return hw


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine and workload options (cpu_engine_args, gpu_engine_args), shared with overhead_profile."""
    ap.add_argument("--requests", type=int, default=64, help="CPU: requests per round")
    ap.add_argument("--max-tokens", type=int, default=32, help="CPU: tokens per request")
    ap.add_argument("--gpu", action="store_true", help="upstream's CUDA engine on the race recipe (Qwen3-0.6B shapes)")
    ap.add_argument("--backend", choices=("TRITON_ATTN", "FLASH_ATTN"), default="FLASH_ATTN", help="--gpu: the attention backend")
    ap.add_argument("--eager", action="store_true", help="--gpu: enforce_eager (no CUDA graphs, no torch.compile)")
    ap.add_argument("--num-seqs", type=int, default=256, help="--gpu: sequences of the race recipe per round")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per side (default 10; 3 with --gpu)")
    add_engine_args(ap)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.gpu else 10)

    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_tour.probes.install import check_probes
    from vllm_tour.probes.run_env import PIN_ENV
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    os.environ[PIN_ENV] = tag  # the probes look up per-pin facts (e.g. the CUDA backends' KV layouts) by it
    backend = args.backend if args.gpu else None
    resolved = [r for r in check_probes(tag, backend=backend, tp_size=1) if not r.probe.capture_only]
    hook_s: dict[str, float] = {}
    timed = timed_probes(resolved, hook_s)  # for the breakdown round only: timing costs too
    engine_args, shapes, reqs, temperature = (gpu_engine_args if args.gpu else cpu_engine_args)(EngineArgs, args)
    engine = LLMEngine.from_engine_args(engine_args)
    run_round(engine, reqs, SamplingParams, "warmup", temperature)
    # The traced side gets a warm-up round of its own: on the H200 the first traced round ran 0.5-1.3 ms per step
    # slower than the later ones in every run (one-time costs, not the probes' cost per step). Reported apart.
    with tempfile.TemporaryDirectory() as tmp:
        first_traced, _ = run_round(engine, reqs, SamplingParams, "warmup-traced", temperature, resolved, tmp)
    order = (["A", "B", "B", "A"] * rounds)[: 2 * rounds]
    rounds_wall: list[float] = []  # in run order
    wall: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    traced_steps = steps = 0
    with tempfile.TemporaryDirectory() as tmp:
        for k, side in enumerate(order):
            w, c = run_round(engine, reqs, SamplingParams, f"{side}{k}", temperature,
                             resolved if side == "B" else None, tmp)
            wall[side].append(statistics.mean(w))
            rounds_wall.append(wall[side][-1])
            cpu[side].append(statistics.mean(c))
            steps = len(w)
        trace_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        for k in range(1 if args.gpu else 2):  # the breakdown: probes with timed hooks
            w, _ = run_round(engine, reqs, SamplingParams, f"T{k}", temperature, timed, tmp)
            traced_steps += len(w)

    import vllm

    med = {s: statistics.median(v) for s, v in wall.items()}
    cmed = {s: statistics.median(v) for s, v in cpu.items()}
    mn = {s: min(v) for s, v in wall.items()}
    cmn = {s: min(v) for s, v in cpu.items()}
    hooks = sum(hook_s.values()) / traced_steps
    blocks = [rounds_wall[i : i + 4] for i in range(0, len(rounds_wall) - 3, 4)]  # A B B A
    pairs = sorted((b[1] + b[2]) / (b[0] + b[3]) for b in blocks)
    top = sorted(hook_s.items(), key=lambda kv: -kv[1])[:4]
    hw = hardware()
    goal = 1.02 if args.gpu else 1.03
    load = os.getloadavg()[0]
    work = (f"{len(reqs)} sequences of the race recipe ({sum(m for _, m in reqs)} output tokens)" if args.gpu
            else f"{args.requests} requests, prompts 16-128 tokens, {args.max_tokens} tokens each (ignore_eos)")
    print(f"hardware: {hw['cpu']}{' (AMX)' if hw['amx'] else ''}, {hw['cores']} cores{', ' + hw['gpu'] if 'gpu' in hw else ''}, "
          f"{hw['system']}, load average {load:.1f}")
    print(f"engine:   vLLM {vllm.__version__} (pin {tag}), {shapes}, in-process")
    print(f"workload: {work}, {steps} steps per round")
    print(f"rounds:   {rounds} per side, interleaved A B B A; {trace_bytes // 1024} KiB of records written by the traced rounds")
    print(f"wall:     untraced {med['A'] * 1e3:.2f} ms/step, traced {med['B'] * 1e3:.2f} ms/step (medians over rounds) -> ratio {med['B'] / med['A']:.3f}")
    print(f"cpu:      untraced {cmed['A'] * 1e3:.2f} ms/step, traced {cmed['B'] * 1e3:.2f} ms/step (medians over rounds) -> ratio {cmed['B'] / cmed['A']:.3f}")
    if pairs:
        print(f"pairs:    wall ratio per A B B A block: median {statistics.median(pairs):.3f}, "
              f"spread {pairs[0]:.3f}..{pairs[-1]:.3f} over {len(pairs)} blocks")
    print(f"minimum:  wall untraced {mn['A'] * 1e3:.2f} / traced {mn['B'] * 1e3:.2f} ms/step -> ratio {mn['B'] / mn['A']:.3f}; "
          f"cpu {cmn['A'] * 1e3:.2f} / {cmn['B'] * 1e3:.2f} -> ratio {cmn['B'] / cmn['A']:.3f} (fastest round per side)")
    print(f"hooks:    {hooks * 1e6:.0f} us CPU per step inside probe hooks (extra timed rounds) = {hooks / cmed['A']:.1%} of the untraced step's CPU time")
    print("          costliest: " + ", ".join(f"{k} {v / traced_steps * 1e6:.0f} us" for k, v in top))
    print(f"warm-up:  the first traced round (not in the ratios) {statistics.mean(first_traced) * 1e3:.2f} ms/step")
    print(f"overhead (step-time ratio, wall): {med['B'] / med['A']:.3f}   goal <= {goal}")
    if args.json:
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m vllm_tour.bench.overhead " + " ".join(sys.argv[1:]),
            "hardware": {**hw, "load_average": round(load, 2)},
            "vllm_version": vllm.__version__, "pin": tag, "engine": shapes, "workload": work, "steps_per_round": steps,
            "rounds_per_side": rounds, "trace_bytes": trace_bytes, "goal": goal,
            "ratio": {"wall": round(med["B"] / med["A"], 4), "cpu": round(cmed["B"] / cmed["A"], 4),
                      "wall_min": round(mn["B"] / mn["A"], 4), "cpu_min": round(cmn["B"] / cmn["A"], 4),
                      "wall_blocks": [round(x, 4) for x in pairs]},
            "ms_per_step": {"wall": {s: [round(x * 1e3, 3) for x in v] for s, v in wall.items()},
                            "cpu": {s: [round(x * 1e3, 3) for x in v] for s, v in cpu.items()}},
            "first_traced_round_ms_per_step": round(statistics.mean(first_traced) * 1e3, 3),
            "hooks_us_per_step": round(hooks * 1e6, 1),
            "hooks_us_per_step_by_probe": {k: round(v / traced_steps * 1e6, 1) for k, v in sorted(hook_s.items(), key=lambda kv: -kv[1])},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
