"""The reimpl side of a comparison: the reference engine built from a module's components (a learner's
own where `impl` names them), run with upstream's effective settings."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from vllm_tour.compare.components import check_impl, load_impl
from vllm_tour.compare.modules import MODULES, get_module
from vllm_tour.compare.options import carried_config, check_extra
from vllm_tour.compare.upstream import DTYPES, UpstreamRecords, is_moe_model
from vllm_tour.errors import TourError
from vllm_tour.trace.logprobs import TOP_K


def applicable(scenario, module: str | None = None) -> str | None:
    """Why `module` (None: a single-device one) cannot run this scenario, or None if it can."""
    if scenario.engine.load_format == "dummy":
        return "load_format dummy (upstream's random weights are in no checkpoint the reimpl could load)"
    try:  # an option upstream would run with and the reimpl without: the reimpl would look wrong
        check_extra(scenario.engine.extra)
    except TourError as e:
        return str(e)
    if "speculative_config" in scenario.engine.extra:
        if not (module and get_module(module).speculative):
            spec = ", ".join(name for name, m in MODULES.items() if m.speculative)
            return f"speculative decoding ({spec} compares it)"
        if DTYPES.get(scenario.engine.dtype) != "float32":
            return f"dtype {scenario.engine.dtype} with speculative decoding (its compare runs float32)"
    world = get_module(module).world_size if module else 1
    tp = scenario.engine.tensor_parallel_size
    ep = scenario.engine.enable_expert_parallel and tp > 1
    if ep and not (module and get_module(module).expert_parallel == tp):
        multi = ", ".join(name for name, m in MODULES.items() if m.expert_parallel == tp) or "no module"
        return f"expert parallelism at TP={tp} ({multi} compares EP={tp} runs)"
    if tp != world and not ep:
        if world == 1:
            return f"tensor_parallel_size={tp} (this module's reimpl is single-device; {_tp_modules(scenario)})"
        return f"tensor_parallel_size={tp} ({module} compares TP={world} runs only)"
    if world > 1 and DTYPES.get(scenario.engine.dtype) != "float32":
        return f"dtype {scenario.engine.dtype} ({module} runs float32)"
    moe_only = bool(module) and get_module(module).moe_only
    if world > 1 or moe_only:  # single-device modules run both (reimpl/moe.py's Qwen3MoE for MoE checkpoints)
        moe = is_moe_model(scenario.model)
        if world > 1 and moe and not moe_only:
            return f"model {scenario.model} is MoE ({module}'s model is the dense Qwen3; {_tp_modules(scenario)})"
        if moe_only and not moe:
            return f"model {scenario.model} is dense ({module} judges MoE routing and expert placement)"
    if scenario.engine.dtype not in DTYPES:
        return f"dtype {scenario.engine.dtype} (the reimpl runs float32 or bfloat16)"
    return None


def _tp_modules(scenario) -> str:
    """Which modules compare this scenario's TP size and kind of model, in words."""
    tp, moe = scenario.engine.tensor_parallel_size, is_moe_model(scenario.model)
    names = [name for name, m in MODULES.items() if m.world_size == tp and m.moe_only == moe]
    return f"{', '.join(names) or 'no module'} compares {'MoE ' if moe else ''}TP={tp}"


def check_module(module: str) -> None:
    if get_module(module).triton:
        _use_triton_interpreter_without_gpu(module)
    try:
        importlib.import_module(module)
    except Exception as e:  # a learner's broken module: could not run
        raise TourError(f"cannot import {module}: {type(e).__name__}: {e}") from None


def _use_triton_interpreter_without_gpu(module: str) -> None:
    """Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import:
    set it before the kernel's module is first imported. vLLM's CPU engine runs
    no Triton kernel, so the upstream side is unaffected."""
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:  # Triton fixes its mode when first imported
        raise TourError(f"{module} needs the Triton interpreter on a machine without a GPU, but Triton "
                        "was already imported in this process without it: set TRITON_INTERPRET=1 before Python "
                        "starts (the vllm-tour command does this itself)")
    os.environ["TRITON_INTERPRET"] = "1"


def engine_components(module: str, impl: dict[str, str | object] | None = None) -> dict[str, object]:
    """{component: class or function} for the reference engine: the module's references, with the learner's
    objects from `impl` (a "FILE.py[:Name]" spec, or the object itself) in their place, each checked."""
    m = get_module(module)
    for name in impl or {}:
        if name not in m.components:
            raise TourError(f"--impl {name}: {module} has no component {name!r} (its components: "
                            f"{', '.join(m.components)})")
    parts = {}
    for name, ref in m.components.items():
        given = (impl or {}).get(name)
        if isinstance(given, str):
            parts[name] = load_impl(name, given)
        elif given is not None:
            check_impl(name, given)
            parts[name] = given
        else:
            mod, obj = ref.split(":")
            parts[name] = getattr(importlib.import_module(mod), obj)
    if m.triton:
        import torch

        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            parts["paged_attention"] = _on_gpu(parts["paged_attention"])
    return parts


def _on_gpu(attention: Callable) -> Callable:
    """The mini engine keeps its tensors on the CPU; a compiled Triton kernel needs them on the GPU.
    K/V are written into the engine's (CPU) cache as usual, the cache and the queries go to the GPU
    for the kernel, and the output comes back: the engine, its captures and its decisions are unchanged."""
    from types import SimpleNamespace

    def attend(q, k_new, v_new, cache, meta, **options):
        cache.write(k_new, v_new, meta.slot_mapping)
        on_gpu = SimpleNamespace(k=cache.k.cuda(), v=cache.v.cuda(), write=lambda *_: None)
        return attention(q.cuda(), k_new, v_new, on_gpu, meta, **options).cpu()

    return attend


def model_factory(module: str) -> Callable | None:
    """(model_dir, dtype, attention) -> the module's multi-rank model (modules.CompareModule.model), or None."""
    m = get_module(module)
    if not m.model:
        return None
    mod, name = m.model.split(":")
    build = getattr(importlib.import_module(mod), name)
    return lambda model_dir, dtype, attention: build(model_dir, m.world_size, dtype, attention)


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


def run_reimpl(scenario, up: UpstreamRecords, components: dict[str, object], engine_factory: Callable | None = None,
               capture: tuple[str, ...] = (), on_step=None, dtype: str = "float32", build_model: Callable | None = None):
    """Run the reimpl mini engine with upstream's effective settings; returns (engine, results, notes).

    capture: the tensor kinds to capture per layer (the module's captures, or none).
    In bf16 every request runs on upstream's tokens (teacher forcing) while the engine records its own
    greedy token and top-k at each position: up to the first difference that is the same as running
    free, and after it decisions and tensors stay comparable (see tokens.logprobs_close)."""
    from reimpl.engine import Engine, EngineConfig, RequestIn

    notes: list[str] = []
    first = up.steps[min(up.steps)] if up.steps else {}
    sched, kv = first.get("scheduler"), first.get("kv")
    if sched is None or kv is None:
        raise TourError("the upstream run has no scheduler/KV records: were probes installed?")
    args = up.meta["engine_args"]
    model_dir = up.model_dir
    from vllm_tour.upstream import pins

    policies = pins.pin_profile(up.meta["pin"]).reimpl_policies()
    carried = carried_config(args)  # the scheduling options upstream ran with (options.CARRIED)
    cfg = EngineConfig(
        model_dir=str(model_dir),
        block_size=kv["block_size"],
        num_blocks=kv["num_blocks"] + 1,  # records count usable blocks; + the null block
        max_num_batched_tokens=sched["token_budget"],
        max_num_seqs=sched["max_num_seqs"],
        max_model_len=args.get("max_model_len") or scenario.engine.max_model_len,
        enable_prefix_caching=bool(kv["prefix_caching"]),
        dtype=dtype,
        bf16_attention_weights=up.isa == "amx",
        **policies,
        **carried,
    )
    for k, v in carried.items():
        notes.append(f"carried from upstream's engine args: {k}={v}")
    if cfg.bf16_attention_weights:
        notes.append("upstream ran the AMX CPU attention kernel: the reimpl rounds its softmax weights to bf16 "
                     "before P·V as that kernel does (paged_attn.paged_attention bf16_weights)")
    for k, v in policies.items():  # where upstream's behaviour changed between pins, the reimpl follows the run's
        if v != EngineConfig.__dataclass_fields__[k].default:
            notes.append(f"reimpl policy for pin {up.meta['pin']}: {k}={v}")
    eos = _eos_token_id(model_dir)
    by_id = {r.req_id: r for r in scenario.requests}
    requests = []
    for r in up.meta["requests"]:
        # runs recorded before meta carried ignore_eos take it from the scenario
        ignore_eos = r.get("ignore_eos")
        if ignore_eos is None:
            spec = by_id.get(r["req_id"])
            ignore_eos = bool(spec.ignore_eos) if spec else False
        requests.append(RequestIn(r["req_id"], list(r["prompt_token_ids"]), r["max_tokens"], r.get("temperature") or 0.0,
                                  r.get("seed"), r.get("arrival_step") or 0, None if ignore_eos else eos))
    # a multi-rank model runs the engine's attention (a learner's, with --impl paged_attention=...)
    model = build_model(str(model_dir), dtype, components["paged_attention"]) if build_model else None
    engine = engine_factory(cfg) if engine_factory else Engine(cfg, model, **components)
    for r in requests:
        if r.temperature > 0:
            engine.forced[r.req_id] = list(up.outputs.get(r.req_id, []))
            notes.append(f"{r.req_id}: temperature {r.temperature} -> upstream's tokens are forced (CPU sampling noise "
                         "comes from a C++ op, fused_gumbel_argmax); its tokens are not compared")
        elif dtype != "float32":
            engine.forced[r.req_id] = list(up.outputs.get(r.req_id, []))
    if dtype != "float32":
        engine.record_topk = TOP_K
    # per layer, except "tp": every collective of a TP model (reimpl/tp.py), whatever its layer
    names = tuple(c if c == "tp" else f"{c}.layers.{i}" for c in capture for i in range(engine.model.num_layers))
    names = tuple(dict.fromkeys(names))
    try:
        results = engine.run(requests, capture=names, on_step=on_step)
    except Exception as e:
        e._engine = engine  # the harness still diffs the steps that ran
        raise
    return engine, results, notes
