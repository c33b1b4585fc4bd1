"""Run upstream (with probes) and the reimpl on one scenario, then diff them.

    result = compare("reimpl.paged_attn", "traces/scenarios/cmp_single.toml")
    result.exit_code  # 0 clean, 1 diverged (2 is raised as TourError: could not run)
    compare("reimpl.paged_attn", scenario, impl={"block_pool": "labs/my_pool.py:BlockPool"})

modules.py      what each module swaps in and is judged on
components.py   the swappable components' interfaces, load_impl
upstream.py     the upstream run (cached per scenario), read through trace.reader
reimpl_side.py  the reference engine with the module's (or the learner's) components
tensor_diff.py  captured tensors; explain.py  --explain; result.py  CompareResult

What is not compared, and why, goes into the result as well (CompareResult.not_compared).
"""

from __future__ import annotations

import inspect
import time
import traceback
from pathlib import Path
from typing import Callable

from vllm_tour.compare import diffs, tolerance
from vllm_tour.compare.diffs import Divergence
from vllm_tour.compare.explain import explain as explain_divergence
from vllm_tour.compare.explain import topk_notes
from vllm_tour.compare.modules import CAPTURES, MODULES, get_module
from vllm_tour.compare.reimpl_side import applicable, check_module, engine_components, model_factory, run_reimpl
from vllm_tour.compare.result import CompareResult
from vllm_tour.compare.tensor_diff import diff_tensors
from vllm_tour.compare.tp_diff import diff_tp
from vllm_tour.compare.upstream import cannot_run_here, load_upstream, run_dtype, upstream_run_for
from vllm_tour.errors import TourError
from vllm_tour.paths import SCENARIOS_DIR
from vllm_tour.trace.logprobs import TOP_K


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


def compare(module: str, scenario_path: Path | str, *, fresh: bool = False, upstream_run: Path | None = None,
            impl: dict[str, str | object] | None = None, engine_factory: Callable | None = None,
            tensors: bool | None = None, explain: bool = False, atol: float | None = None, rtol: float | None = None,
            progress=None) -> CompareResult:
    """Compare one reimpl module with upstream on one scenario. TourError = could not run (exit 2).

    impl: {component: "FILE.py[:Name]" or the class/function itself}: the learner's own in place of the
    reference (components.COMPONENTS); checked before any engine starts. engine_factory(cfg) builds the
    engine instead (tests); not with impl.
    Tensor tolerance: atol/rtol when given, else chosen from the upstream run's dtype, attention
    backend and env (tolerance.tolerance_for: fp32 1e-5; TF32 dots on CUDA Triton 1e-2, unless the run
    recorded TRITON_F32_DEFAULT=ieee; bf16 tolerance.BF16). Tokens: exact in fp32; in bf16 vLLM's top-k
    rule (diffs.diff_tokens_topk), the reimpl running on upstream's tokens (run_reimpl)."""
    from vllm_tour.scenario import load_scenario

    t0 = time.perf_counter()
    check_module(module)
    if impl and engine_factory:
        raise TourError("give impl or engine_factory, not both")
    components = engine_components(module, impl)
    scenario = load_scenario(scenario_path)
    why = applicable(scenario, module)
    if why:
        raise TourError(f"scenario {scenario.name}: the reimpl cannot run it: {why}")
    if upstream_run is None and (why := cannot_run_here(scenario)):
        raise TourError(f"scenario {scenario.name}: upstream cannot run it here: {why}")
    run_dir = Path(upstream_run) if upstream_run else upstream_run_for(scenario, fresh=fresh, progress=progress)
    up = load_upstream(run_dir)
    if up.meta.get("status") != "ok":
        raise TourError(f"upstream run {run_dir} did not finish ok: {up.meta.get('error')}")
    if up.probe_errors:
        first_error = up.probe_errors[0]
        raise TourError(f"upstream run {run_dir} has probe errors (first: {first_error['probe']}: {first_error['error']})")
    if upstream_run is not None:
        _check_run_is_of(scenario, up, run_dir)
    captures = get_module(module).captures
    one_device = (up.meta.get("engine_args") or {}).get("tensor_parallel_size", 1) == 1
    if one_device:  # no rank of upstream's computed a partial (reimpl.ep's simulated ranks are judged on placement)
        captures = tuple(c for c in captures if c != "moe_partial")
    if tensors is None:
        tensors = bool(captures)
    backend = up.backend
    dtype = run_dtype(up)
    if dtype != "float32" and not up.top:
        raise TourError(f"upstream run {run_dir} ran in {dtype} but recorded no top-k logprobs, which the {dtype} "
                        f"token rule needs: rerun it with logprobs (engine.run.run_upstream(..., logprobs={TOP_K}))")
    tol = tolerance.tolerance_for(backend, up.meta.get("env"), dtype)
    if atol is not None or rtol is not None:
        tol = tolerance.Tolerance(tol.atol if atol is None else atol, tol.rtol if rtol is None else rtol, "given",
                              "set by the caller (--atol/--rtol)")
    collected: list = []
    crash: Divergence | None = None
    try:
        engine, results, notes = run_reimpl(scenario, up, components, engine_factory,
                                            capture=(captures or CAPTURES) if tensors else (),
                                            on_step=collected.append, dtype=dtype, build_model=model_factory(module))
    except TourError:
        raise
    except Exception as e:  # the reimpl crashed: a divergence at the step it crashed in
        engine, results, notes = getattr(e, "_engine", None), list(collected), []
        # the engine says which step and phase it was in; else (an engine_factory's engine) the step after the last one done
        step, phase = getattr(engine, "where", None) or (results[-1].out.step + 1 if results else 1, None)
        partial = getattr(engine, "current_step", None)
        if partial is not None and (not results or results[-1] is not partial):
            results.append(partial)
        crash = _crash_divergence(e, step, phase, components)

    re_steps: dict[int, dict] = {}
    re_tensors: dict[int, dict] = {}
    re_state: dict[int, dict] = {}
    for res in results:
        step = res.out.step
        re_steps[step] = {rec["kind"]: rec for rec in res.records if rec["kind"] != "moe"}
        re_steps[step]["moe"] = [rec for rec in res.records if rec["kind"] == "moe"]
        re_steps[step]["attention"] = diffs.reimpl_attention(re_steps[step].get("runner"), re_steps[step].get("kv"))
        re_tensors[step] = res.tensors
        re_state[step] = res.state

    # forced: randomly sampled requests, whose tokens are upstream's and not compared (in bf16 the
    # greedy ones run on upstream's tokens too, but their own greedy choices are compared by the top-k rule)
    sampled_at = {r["req_id"]: r["temperature"] for r in up.meta["requests"] if (r.get("temperature") or 0) > 0}
    forced = set(sampled_at)
    re_outputs = engine.outputs() if engine else {}
    if engine and dtype != "float32":  # the reimpl's own greedy picks, not the tokens it was given
        re_outputs.update({rid: engine.greedy.get(rid, []) for rid in re_outputs if rid not in forced})
    verdicts: dict[str, dict] = {}
    sections = get_module(module).sections
    if crash is None:
        up_cmp = {k: v for k, v in up.outputs.items() if k not in forced}
        re_cmp = {k: v for k, v in re_outputs.items() if k not in forced}
        if dtype == "float32":
            divs = diffs.diff_tokens(up_cmp, re_cmp)
        else:
            divs, verdicts = diffs.diff_tokens_topk(up_cmp, up.top, re_cmp, engine.topk)
            notes += topk_notes(verdicts, up.steps, dtype)
        divs += diffs.diff_steps(up.steps, re_steps, sections)
    else:  # compare what ran, up to and including the step that crashed
        divs = diffs.diff_steps({s: v for s, v in up.steps.items() if s < crash.step},
                                {s: v for s, v in re_steps.items() if s < crash.step}, sections)
        # the records the crashing step made before it raised (the decision made before the model ran)
        at_crash = re_steps.get(crash.step, {})
        if crash.step in up.steps and at_crash:
            divs += diffs.diff_step(crash.step, up.steps[crash.step], at_crash,
                                    tuple(x for x in sections if at_crash.get(x) is not None))
        divs.append(crash)
    not_compared = _not_compared(module, up, sampled_at, verdicts, crash, tensors)
    if one_device and "moe_partial" in get_module(module).captures:
        not_compared.append({"what": "moe_partial (each rank's MoE output before the all-reduce)",
                             "why": "upstream ran on one device, so it has no partials; the simulated ranks are judged on "
                                    "their expert maps and local token counts against upstream's determine_expert_map"})
    tstats = []
    world = get_module(module).world_size
    if tensors and world > 1:
        tp_divs, tstats = diff_tp(run_dir, engine.model if engine else None, up.steps, re_steps, re_tensors,
                                  tol.atol, tol.rtol, not_compared)
        divs += tp_divs
        if crash is None:
            divs += _tp1_tokens(scenario, up, components, {k: v for k, v in up.outputs.items() if k not in forced}, dtype)
    elif tensors:
        ran = {s: v for s, v in up.steps.items() if crash is None or s < crash.step}
        tstats, skipped = diff_tensors(run_dir, ran, re_steps, re_tensors, tol.atol, tol.rtol, captures or CAPTURES)
        tstats = tolerance.pool_steps(tstats, tol)
        not_compared += skipped

    tokens = {rid: {"upstream": up.outputs.get(rid), "reimpl": re_outputs.get(rid), "forced": rid in forced}
              for rid in sorted(set(up.outputs) | set(re_outputs))}
    for rid, v in verdicts.items():
        tokens[rid]["top_k_rule"] = v  # ok, identical, first_diff, both tokens and top-k lists there
    impl_names = {name: given if isinstance(given, str) else f"{inspect.getsourcefile(given)}:{given.__qualname__}"
                  for name, given in (impl or {}).items()}
    result = CompareResult(module, scenario.name, str(scenario_path), str(run_dir), len(up.steps), len(re_steps),
                           tokens, divs, tstats, notes, tolerance=tol, upstream_backend=backend, upstream_isa=up.isa, dtype=dtype,
                           impl=impl_names, not_compared=not_compared, tensors_judged=tensors)
    for name, given in impl_names.items():
        result.notes.append(f"{name}: the learner's {given} (every other component: the reference)")
    if explain or not result.clean:
        result.explain = explain_divergence(result, up.steps, re_steps, re_state)
    result.duration_s = time.perf_counter() - t0
    return result


def _check_run_is_of(scenario, up, run_dir: Path) -> None:
    """A run given by path must be one of this scenario: same model, TP size and prompts."""
    args = up.meta.get("engine_args") or {}
    theirs = (up.meta.get("model"), args.get("tensor_parallel_size", 1), [r["prompt_token_ids"] for r in up.meta["requests"]])
    ours = (scenario.model, scenario.engine.tensor_parallel_size, [r.prompt_token_ids for r in scenario.requests])
    for what, a, b in zip(("model", "tensor_parallel_size", "prompts"), theirs, ours):
        if a != b and not (what == "prompts" and None in b):  # a text prompt: tokenized by upstream
            raise TourError(f"upstream run {run_dir} is not a run of scenario {scenario.name}: its {what} differs"
                            + ("" if what == "prompts" else f" ({a} vs {b})"))


def _tp1_tokens(scenario, up, components, tp_outputs: dict, dtype: str) -> list[Divergence]:
    """TP changes where the sums are split, not what is computed: the single-device reimpl (reimpl/qwen3.py) on the
    same requests must give the same tokens as the TP run (fp32)."""
    engine, _, _ = run_reimpl(scenario, up, components, dtype=dtype)
    divs = []
    for rid, tokens in sorted(engine.outputs().items()):
        if rid not in tp_outputs:
            continue  # sampled: forced
        if tokens != tp_outputs.get(rid):
            divs.append(Divergence("tokens", None, f"tokens.tp1[{rid}]", tp_outputs.get(rid), tokens, rid,
                                   f"{rid}: the TP=1 reimpl (reimpl/qwen3.py) generates other tokens than upstream at TP=2"))
    return divs


def _crash_divergence(e: Exception, step: int, phase: str | None, components: dict[str, object]) -> Divergence:
    """The crash as a divergence at the step the engine was in, naming what it was doing (Engine.where)
    and the innermost frame in reimpl/ or in a learner's file."""
    own = {getattr(inspect.getmodule(obj), "__file__", None) for obj in components.values()}
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(tb)
                  if ("reimpl" in f.filename or f.filename in own) and f.name != "tracked_call"), "?")  # not Engine._tracked's wrapper
    doing = f" during {phase}" if phase else ""
    return Divergence("crash", step, "reimpl.exception", None, f"{type(e).__name__}: {e}"[:500], None,
                      f"the reimpl raised in step {step}{doing}, at {where}")


def _not_compared(module: str, up, sampled_at: dict[str, float], verdicts: dict[str, dict], crash: Divergence | None,
                  tensors: bool) -> list[dict]:
    """What this comparison does not judge, and why: [{what, why}] (tensor_diff adds the tensors' own)."""
    out = []
    if not tensors:
        judged = " or ".join(name for name, m in MODULES.items() if m.captures)
        out.append({"what": "tensors (attention outputs, KV cache blocks)",
                    "why": f"{module} is judged on its decisions and tokens only; tensors are judged by {judged}"})
    for rid, temperature in sorted(sampled_at.items()):
        out.append({"what": f"sampled tokens of {rid} (temperature {temperature})",
                    "why": "random sampling: upstream's noise comes from a C++ op (fused_gumbel_argmax on CPU) the reimpl "
                           "does not reproduce, so upstream's tokens are forced into the reimpl"})
    for rid, v in sorted(verdicts.items()):
        if v["ok"] and not v["identical"]:
            out.append({"what": f"tokens of {rid} after output position {v['first_diff']}",
                        "why": f"{run_dtype(up)}: the greedy tokens first differ there, each in the other's top-{TOP_K} "
                               "(vLLM's rule); after it the reimpl runs on upstream's tokens"})
    missing = [s for s, v in sorted(up.steps.items()) if v.get("runner") and diffs.logits_not_recorded(v["runner"])]
    if missing:
        out.append({"what": f"runner.logits_indices at {len(missing)} step(s) (first: {missing[0]})",
                    "why": "not recorded in this run (upstream's runner record has none)"})
    if crash is not None:
        last = max(up.steps, default=crash.step)
        out.append({"what": f"step {crash.step} after the reimpl raised, and steps {crash.step + 1}..{last}"
                            if last > crash.step else f"step {crash.step} after the reimpl raised",
                    "why": "the reimpl raised; tokens are not compared either"})
    return out


def write_report(result: CompareResult, path: Path) -> Path:
    from vllm_tour.trace.writer import write_json_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result.to_json())
    return path
