"""Probe overhead: the same workload untraced vs traced, A/B interleaved in one process.

    python -m vllm_tour.bench.overhead [--rounds 10] [--requests 64] [--max-tokens 32] [--json PATH]
    python -m vllm_tour.bench.overhead --gpu --backend FLASH_ATTN|TRITON_ATTN [--eager] [--rounds 3] [--json PATH]

CPU (default): one in-process engine, tiny-qwen3 in fp32, 64 requests x 32
tokens, prefix caching off so every round does the same work.
--gpu: upstream's CUDA engine (the GPU machine's v0.21.0) on the race's recipe
(vllm_tour/bench/race_recipe.py: Qwen3-0.6B shapes with dummy weights, bf16,
max_model_len 4096, 256 sequences; --num-seqs fewer), CUDA graphs + torch.compile
unless --eager, the attention backend given by --backend.
Sides: untraced (the probes uninstalled: pristine upstream callables) and one side per trace level
(vllm_tour/trace/levels.py: steps, blocks, full), each with only the probes its level installs (no
tensors; no TP probes at TP=1). Rounds run every side once per pass, each pass in the reverse order of
the last (U S B F F B S U ...), so a slow drift of the machine's load cancels. Each traced side first
runs one warm-up round that is not in the ratios (printed: what a trace's first round costs once).

Per level: the wall ratio (median step time over rounds, traced / untraced: what a user feels), its
spread over passes, the CPU ratio, and the breakdown from extra timed rounds: CPU time inside the hooks,
and the wrappers' own cost (calls per step x the cost of one wrapper call, measured on a no-op).
The last line, `ratio steps=<x> blocks=<y> full=<z>`, is the one to compare run to run.
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
              run_dir: str | None = None, level: str = "full") -> tuple[list[float], list[float]]:
    """Run the workload to completion; (wall seconds, process CPU seconds) per step. With `probes` (resolved
    probes, those of `level`): installed and recording into `run_dir` for this round only."""
    from vllm_tour.probes.base import install, uninstall
    from vllm_tour.trace.writer import RECORDER

    if probes is not None:
        install(probes, RECORDER)
        RECORDER.activate(run_dir, "", "", level=level)
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


def counted(fn, acc: dict[str, int], label: str):
    """`fn` with its calls counted in acc[label]."""
    acc[label] = 0

    def call(*a, **k):
        acc[label] += 1
        return fn(*a, **k)

    return call


def wrapper_calls(hook_calls: dict[str, int]) -> dict[str, int]:
    """Calls of each probe's wrapper from its hooks' counts ("<probe>.before"/".after": one call runs both)."""
    out: dict[str, int] = {}
    for label, n in hook_calls.items():
        probe = label.rpartition(".")[0]
        out[probe] = max(out.get(probe, 0), n)
    return out


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


def write_results(path, module: str, figures: dict) -> None:
    """A benchmark's figures as JSON, headed by when and how it ran (`python -m MODULE ARGS`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": f"python -m {module} " + " ".join(sys.argv[1:])}
    path.write_text(json.dumps({**head, **figures}, indent=1) + "\n")


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


def wrapper_cost_per_call(calls: int = 200_000) -> float:
    """Seconds one probe wrapper adds to a call, hooks aside: a wrapped no-op with a no-op after-hook,
    recording on, against the same no-op hook called directly (both timed here, side by side)."""
    from vllm_tour.probes.base import Probe, Resolved, make_wrapper

    class _On:  # what the wrapper reads of the recorder on its hot path
        active, capture, fault, level_rank = True, set(), None, 2

    def target(self):
        return None

    def hook(token, result, self):
        return None

    probe = Probe(name="bench.noop", target="bench.noop", params=("self",), records="", pins=(), after=hook)
    wrapped = make_wrapper(Resolved(probe, None, "target", target), _On())
    best = []
    for fn in (wrapped, lambda self: hook(None, target(self), self)):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(None)
            runs.append(time.perf_counter() - t0)
        best.append(min(runs) / calls)
    return best[0] - best[1]


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
    from vllm_tour.trace.levels import LEVELS
    from vllm_tour.upstream.pins import active_pin_tag

    tag = active_pin_tag()
    os.environ[PIN_ENV] = tag  # the probes look up per-pin facts (e.g. the CUDA backends' KV layouts) by it
    backend = args.backend if args.gpu else None
    resolved = {lv: [r for r in check_probes(tag, backend=backend, tp_size=1, level=lv) if not r.probe.capture_only]
                for lv in LEVELS}
    sides = ["untraced", *LEVELS]
    engine_args, shapes, reqs, temperature = (gpu_engine_args if args.gpu else cpu_engine_args)(EngineArgs, args)
    engine = LLMEngine.from_engine_args(engine_args)
    run_round(engine, reqs, SamplingParams, "warmup", temperature)
    # Each traced side gets a warm-up round of its own: on the H200 the first traced round ran 0.5-1.3 ms per step
    # slower than the later ones in every run (one-time costs, not the probes' cost per step). Reported apart.
    first_traced = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lv in LEVELS:
            first_traced[lv], _ = run_round(engine, reqs, SamplingParams, f"warmup-{lv}", temperature, resolved[lv], tmp, lv)
    # Blocks of every side, forward then backward (A B C D D C B A ...): a slow drift of the machine's load
    # cancels within a block of two passes.
    order = [side for k in range(rounds) for side in (sides if k % 2 == 0 else sides[::-1])]
    wall: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    trace_bytes: dict[str, int] = {}
    steps = 0
    for k, side in enumerate(order):
        with tempfile.TemporaryDirectory() as tmp:
            traced = side != "untraced"
            w, c = run_round(engine, reqs, SamplingParams, f"{side}{k}", temperature,
                             resolved[side] if traced else None, tmp, side if traced else "full")
            trace_bytes[side] = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        wall[side].append(statistics.mean(w))
        cpu[side].append(statistics.mean(c))
        steps = len(w)
        print(f"round {k + 1}/{len(order)} {side}: {wall[side][-1] * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
    # The breakdown: each level's probes with timed hooks (timing costs too: these rounds are not in the ratios)
    hook_s: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, int]] = {}
    traced_steps: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lv in LEVELS:
            hook_s[lv], calls[lv] = {}, {}
            timed = wrapped_hooks(resolved[lv], lambda label, fn, lv=lv: counted(thread_timed(fn, hook_s[lv], label), calls[lv], label))
            w, _ = run_round(engine, reqs, SamplingParams, f"T{lv}", temperature, timed, tmp, lv)
            traced_steps[lv] = len(w)
    per_call = wrapper_cost_per_call()

    import vllm

    med = {s: statistics.median(v) for s, v in wall.items()}
    cmed = {s: statistics.median(v) for s, v in cpu.items()}
    # per pass of all sides: each level's round against the untraced round of the same pass
    spread = {lv: [wall[lv][n] / wall["untraced"][n] for n in range(rounds)] for lv in LEVELS}
    hw = hardware()
    goal = {"steps": 1.01, "blocks": 1.02, "full": 1.02 if args.gpu else 1.03}
    load = os.getloadavg()[0]
    work = (f"{len(reqs)} sequences of the race recipe ({sum(m for _, m in reqs)} output tokens)" if args.gpu
            else f"{args.requests} requests, prompts 16-128 tokens, {args.max_tokens} tokens each (ignore_eos)")
    ratio = {lv: med[lv] / med["untraced"] for lv in LEVELS}
    print(f"hardware: {hw['cpu']}{' (AMX)' if hw['amx'] else ''}, {hw['cores']} cores{', ' + hw['gpu'] if 'gpu' in hw else ''}, "
          f"{hw['system']}, load average {load:.1f}")
    print(f"engine:   vLLM {vllm.__version__} (pin {tag}), {shapes}, in-process")
    print(f"workload: {work}, {steps} steps per round")
    print(f"rounds:   {rounds} per side ({', '.join(sides)}), each pass of the sides reversed from the last")
    print(f"untraced: {med['untraced'] * 1e3:.2f} ms/step wall, {cmed['untraced'] * 1e3:.2f} ms/step CPU (medians over rounds)")
    for lv in LEVELS:
        sp = sorted(spread[lv])
        hooks = sum(hook_s[lv].values()) / traced_steps[lv]
        n_calls = sum(wrapper_calls(calls[lv]).values()) / traced_steps[lv]
        print(f"{lv + ':':9} wall {med[lv] * 1e3:.2f} ms/step -> ratio {ratio[lv]:.3f} (per pass {sp[0]:.3f}..{sp[-1]:.3f}, "
              f"median {statistics.median(sp):.3f}; goal <= {goal[lv]}); cpu ratio {cmed[lv] / cmed['untraced']:.3f}; "
              f"{trace_bytes[lv] // 1024} KiB per round")
        print(f"          hooks {hooks * 1e6:.0f} us/step ({hooks / cmed['untraced']:.1%} of the untraced step's CPU); wrappers "
              f"{n_calls:.1f} calls/step x {per_call * 1e9:.0f} ns = {n_calls * per_call * 1e6:.1f} us/step; "
              f"first traced round {statistics.mean(first_traced[lv]) * 1e3:.2f} ms/step")
        top = sorted(hook_s[lv].items(), key=lambda kv: -kv[1])[:3]
        print("          costliest: " + ", ".join(f"{k} {v / traced_steps[lv] * 1e6:.0f} us" for k, v in top))
    if args.json:
        write_results(args.json, "vllm_tour.bench.overhead", {
            "hardware": {**hw, "load_average": round(load, 2)},
            "vllm_version": vllm.__version__, "pin": tag, "engine": shapes, "workload": work, "steps_per_round": steps,
            "rounds_per_side": rounds, "order": order, "goal": goal,
            "ratio": {lv: round(ratio[lv], 4) for lv in LEVELS},
            "ratio_per_pass": {lv: [round(x, 4) for x in spread[lv]] for lv in LEVELS},
            "cpu_ratio": {lv: round(cmed[lv] / cmed["untraced"], 4) for lv in LEVELS},
            "ms_per_step": {"wall": {s: [round(x * 1e3, 3) for x in v] for s, v in wall.items()},
                            "cpu": {s: [round(x * 1e3, 3) for x in v] for s, v in cpu.items()}},
            "trace_bytes_per_round": trace_bytes,
            "hooks_us_per_step": {lv: {k: round(v / traced_steps[lv] * 1e6, 1) for k, v in hook_s[lv].items()} for lv in LEVELS},
            "wrapper_calls_per_step": {lv: {k: round(v / traced_steps[lv], 2) for k, v in wrapper_calls(calls[lv]).items()}
                                       for lv in LEVELS},
            "wrapper_ns_per_call": round(per_call * 1e9, 1),
        })
    # last, alone: one line to compare run to run
    print(f"ratio steps={ratio['steps']:.3f} blocks={ratio['blocks']:.3f} full={ratio['full']:.3f}")


if __name__ == "__main__":
    main()
